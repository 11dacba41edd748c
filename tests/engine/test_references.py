"""The recorded Hugging Face references (tests/engine/references.py) still say what HF says: a few entries of each
file, picked anew each day, are computed again on the real model. A failure means HF or torch changed under the
recordings: record them again with `TOKENMILL_RECORD_REFERENCES=1 make test` after deleting the file."""

from __future__ import annotations

import datetime
import json
import random

import pytest

from tests.engine.identity import teacher_forced_verdict
from tests.engine.references import DIR, versions
from tests.engine.test_beam_search import computed_beams

PER_FILE = 2


def entries_of(name: str) -> tuple[dict, list[dict]]:
    recorded = json.loads((DIR / f"{name}.json").read_text())
    return recorded["versions"], list(recorded["entries"].values())


def picked(entries: list[dict]) -> list[dict]:
    seed = datetime.date.today().toordinal()
    print(f"picked with seed {seed}")
    return random.Random(seed).sample(entries, min(PER_FILE, len(entries)))


@pytest.mark.parametrize("name", ["greedy_verdicts", "beams"])
def test_each_file_is_recorded_with_its_versions(name):
    made_by, entries = entries_of(name)
    assert set(made_by) == set(versions()) and len(entries) >= 10
    print(f"{name}: {len(entries)} entries, made with {made_by}; installed {versions()}")


def test_recorded_greedy_verdicts_are_what_hf_says(hf_model):
    _, entries = entries_of("greedy_verdicts")
    assert any(entry["value"] is None for entry in entries)  # HF agreeing exactly is most of them
    for entry in picked(entries):
        key = entry["key"]
        assert key["model"] == hf_model.fingerprint
        assert teacher_forced_verdict(hf_model, key["prompt"], key["output"]) == entry["value"], key


def test_recorded_beams_are_what_hf_says(hf_model):
    _, entries = entries_of("beams")
    for entry in picked(entries):
        key = entry["key"]
        assert key["model"] == hf_model.fingerprint
        beams, scores = computed_beams(hf_model, key["prompt"], key["width"], key["max_tokens"],
                                       key["length_penalty"], key["ignore_eos"])
        assert beams == entry["value"][0], key
        assert scores == pytest.approx(entry["value"][1], abs=1e-5), key
