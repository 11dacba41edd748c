"""A model directory's config and tokenizer, read without importing the model family's modules where transformers
wrote the files: `AutoConfig` / `AutoTokenizer` import the family's config module, which pulls in torch.distributed
and sympy (about 2 s of CPU for every process that loads a model: each worker, each CLI run). Files written
otherwise go through the Auto classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LIGHT_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Family classes whose tokenizer.json holds all they do, read through the base class: GemmaTokenizer builds a tokenizer
# of its own before it reads the file (twice the 2-5 s that Gemma's 262k-token file takes); same ids, text, template
WHOLE_IN_TOKENIZER_JSON = ("GemmaTokenizer",)


def load_config(model_dir: str | Path) -> Any:
    """The model's config. A config.json that transformers wrote holds every field of its family's config class
    (only the base class's defaults are left out), so the base class reads it whole."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if "transformers_version" not in raw or "model_type" not in raw:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_dir)
    from transformers import PretrainedConfig

    config = PretrainedConfig.from_dict(raw)
    config.model_type = raw["model_type"]
    config._name_or_path = str(model_dir)
    return config


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model's tokenizer: the tokenizers-backed class its tokenizer_config.json names, else `AutoTokenizer`."""
    import transformers

    settings = Path(model_dir) / "tokenizer_config.json"
    named = json.loads(settings.read_text()).get("tokenizer_class") if settings.exists() else None
    if named in LIGHT_TOKENIZERS + WHOLE_IN_TOKENIZER_JSON and (Path(model_dir) / "tokenizer.json").exists():
        return getattr(transformers, named if named in LIGHT_TOKENIZERS else "TokenizersBackend").from_pretrained(
            model_dir)
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: Path, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (what `generate` stops on) and the tokenizer."""
    ids: set[int] = set()
    path = model_dir / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
