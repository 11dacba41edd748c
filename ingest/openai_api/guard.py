"""The API's outer layer, pure ASGI, run before any route, dependency or body parser: a body over its cap is
refused (413) from its Content-Length or as soon as the bytes streamed pass the cap, and a request without a live
key is refused (401) before a byte of its body is read. The tenant goes to the routes as `request.state.tenant`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ingest.openai_api.objects import ApiError


class BodyTooLarge(Exception):
    pass


def too_large(limit: int, flag: str) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit:,} bytes ({flag})",
                    code="request_too_large")


async def answer(send: Send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """`body_limit(method, path)` -> (cap in bytes, the flag that sets it); `authenticate(token)` -> the tenant of
    a live key or None (run in a thread: it reads the database)."""

    def __init__(self, app: ASGIApp, body_limit: Callable[[str, str], tuple[int, str]],
                 authenticate: Callable[[str], str | None]) -> None:
        self.app, self.body_limit, self.authenticate = app, body_limit, authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.lower(): value for name, value in scope["headers"]}
        limit, flag = self.body_limit(scope["method"], scope["path"])
        declared = headers.get(b"content-length", b"").strip()
        if declared and (not declared.isdigit() or int(declared) > limit):
            return await answer(send, too_large(limit, flag))
        if (error := await self._authenticate(headers.get(b"authorization"), scope)) is not None:
            return await answer(send, error)
        state: dict[str, Any] = {"received": 0, "over": False, "started": False}

        async def counted_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit:
                    state["over"] = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            if state["over"]:  # the app's answer to a cut body (a parse error, a 500) gives way to the 413
                return
            state["started"] = state["started"] or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not state["over"]:
                raise
        if state["over"] and not state["started"]:
            await answer(send, too_large(limit, flag))

    async def _authenticate(self, authorization: bytes | None, scope: Scope) -> ApiError | None:
        scheme, _, token = (authorization or b"").decode("latin-1").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return ApiError(401, "You didn't provide an API key (Authorization: Bearer <key>).",
                            code="invalid_api_key")
        tenant = await run_in_threadpool(self.authenticate, token) if len(token) <= 512 else None
        if tenant is None:
            return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        scope.setdefault("state", {})["tenant"] = tenant
        return None
