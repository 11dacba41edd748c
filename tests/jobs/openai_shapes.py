"""The OpenAI Batch output line, as documented (platform.openai.com/docs/api-reference/batch/request-output,
chat/object and completions/object), as a JSON schema: what `batch_output.jsonl` lines must validate against. A
request that failed has OpenAI's error `response`; one the batch never ran, a top-level `error`."""

USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                  "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}},
    },
}
TOKEN_LOGPROB = {"type": "object", "required": ["token", "logprob", "bytes"],
                 "properties": {"token": {"type": "string"}, "logprob": {"type": "number", "maximum": 0},
                                "bytes": {"type": ["array", "null"], "items": {"type": "integer"}}}}
CHAT_LOGPROBS = {
    "type": ["object", "null"], "required": ["content"],
    "properties": {"content": {"type": ["array", "null"], "items": {
        **TOKEN_LOGPROB, "required": ["token", "logprob", "bytes", "top_logprobs"],
        "properties": {**TOKEN_LOGPROB["properties"], "top_logprobs": {"type": "array", "items": TOKEN_LOGPROB}}}},
        "refusal": {"type": ["array", "null"]}},
}
COMPLETION_LOGPROBS = {
    "type": ["object", "null"], "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                   "token_logprobs": {"type": "array", "items": {"type": "number", "maximum": 0}},
                   "top_logprobs": {"type": ["array", "null"], "items": {
                       "type": "object", "additionalProperties": {"type": "number", "maximum": 0}}},
                   "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
}
FINISH_REASON = {"enum": ["stop", "length", "content_filter", "tool_calls", "function_call"]}
CHAT_CHOICE = {
    "type": "object",
    "required": ["index", "message", "finish_reason"],
    "properties": {
        "index": {"type": "integer", "minimum": 0},
        "finish_reason": FINISH_REASON,
        "message": {"type": "object", "required": ["role", "content"],
                    "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]}}},
        "logprobs": CHAT_LOGPROBS,
    },
}
COMPLETION_CHOICE = {
    "type": "object",
    "required": ["index", "text", "finish_reason", "logprobs"],
    "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                   "finish_reason": FINISH_REASON, "logprobs": COMPLETION_LOGPROBS},
}


def body(object_name: str, choice: dict) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {"id": {"type": "string"}, "object": {"const": object_name},
                       "created": {"type": "integer"}, "model": {"type": "string"},
                       "choices": {"type": "array", "minItems": 1, "items": choice}, "usage": USAGE},
    }


# a failed request's body, as OpenAI's API answers one (a 4xx or 5xx `response`)
ERROR_BODY = {"type": "object", "required": ["message", "type", "param", "code"],
              "properties": {"message": {"type": "string"},
                             "type": {"enum": ["invalid_request_error", "server_error"]},
                             "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}
BATCH_OUTPUT_LINE = {
    "type": "object",
    "required": ["id", "custom_id", "response", "error"],
    "properties": {"id": {"type": "string"}, "custom_id": {"type": "string"}},
    "oneOf": [
        {"properties": {"error": {"type": "null"},
                        "response": {"type": "object", "required": ["status_code", "request_id", "body"],
                                     "properties": {"status_code": {"const": 200},
                                                    "request_id": {"type": "string"},
                                                    "body": {"oneOf": [body("chat.completion", CHAT_CHOICE),
                                                                       body("text_completion",
                                                                            COMPLETION_CHOICE)]}}}}},
        {"properties": {"error": {"type": "null"},
                        "response": {"type": "object", "required": ["status_code", "request_id", "body"],
                                     "properties": {"status_code": {"type": "integer", "minimum": 400,
                                                                    "maximum": 599},
                                                    "request_id": {"type": "string"},
                                                    "body": {"type": "object", "required": ["error"],
                                                             "properties": {"error": ERROR_BODY}}}}}},
        {"properties": {"response": {"type": "null"},
                        "error": {"type": "object", "required": ["code", "message"],
                                  "properties": {"code": {"enum": ["batch_cancelled", "batch_expired",
                                                                   "batch_failed"]},
                                                 "message": {"type": "string"}}}}},
    ],
}
