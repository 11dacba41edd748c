"""Where tokenmill keeps what it makes once per machine (converted models, timed kernel choices, draft heads)."""

from __future__ import annotations

import os
from pathlib import Path


def tokenmill_home() -> Path:
    """Root of tokenmill's caches ($TOKENMILL_HOME, default ~/.cache/tokenmill)."""
    root = os.environ.get("TOKENMILL_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill")
    return Path(root)
