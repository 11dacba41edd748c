"""Runs inside vLLM's own virtualenv, started by tokenmill/bench/embed.py: `python vllm_embed_worker.py SPEC.json
RESULT.json`. Imports only vLLM and the standard library. SPEC: model (a directory), dtype, texts. RESULT: seconds
of `LLM.embed` over all texts (after a warm-up), start-up seconds, the vectors, vLLM's version."""

import json
import sys
import time


def main(spec_path, result_path):
    from vllm import LLM

    with open(spec_path) as f:
        spec = json.load(f)
    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], runner="pooling", seed=0)
    startup = time.perf_counter() - started
    texts = spec["texts"]
    truncate = {"truncate_prompt_tokens": -1}  # to the model's max_seq_length, as the other systems
    llm.embed(texts[:64], use_tqdm=False, tokenization_kwargs=truncate)  # warm-up
    started = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=False, tokenization_kwargs=truncate)
    seconds = time.perf_counter() - started
    import vllm

    with open(result_path, "w") as f:
        json.dump({"seconds": seconds, "startup_seconds": startup, "version": vllm.__version__,
                   "embeddings": [list(o.outputs.embedding) for o in outputs]}, f)


if __name__ == "__main__":  # vLLM spawns its engine core: LLM(...) must not run at import time
    main(sys.argv[1], sys.argv[2])
