"""The engine factory of the service tests' workers: the real engine, except that a prompt holding POISON
kills the process tokenizing it with SIGKILL, as a row that crashes the engine every time would."""

from __future__ import annotations

import os
import signal

from workers.engine_loader import load_engine

POISON = "POISON-PILL"


def load(settings: dict):
    engine = load_engine(settings)
    encode = engine.encode

    def encode_or_die(text: str, *args, **kwargs):
        if POISON in text:
            os.kill(os.getpid(), signal.SIGKILL)
        return encode(text, *args, **kwargs)

    engine.encode = encode_or_die
    return engine
