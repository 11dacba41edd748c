"""custom_id uniqueness by hashes: a shared hash alone is no duplicate, and the earliest repeat is the one named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from storage.formats import InputError, Limits
from storage.formats.jsonl import JsonlInput
from storage.formats.unique import HashedIds, first_duplicate


def test_hashes_repeat_only_for_repeated_ids():
    ids = HashedIds()
    for custom_id in ("a", "b", "c", "b", "a"):
        ids.add(custom_id)
    assert ids.repeated_hashes() == {hash("a"), hash("b")}
    assert HashedIds().repeated_hashes() == set()


def test_first_duplicate_names_the_earliest_repeat_and_ignores_shared_hashes_of_distinct_ids():
    rows = [(0, "x"), (1, "y"), (2, None), (3, "y"), (4, "x")]
    assert first_duplicate(rows, {hash("x"), hash("y")}) == ("y", 1, 3)
    # as if "x" and "z" collided: distinct ids sharing a hash are no duplicate
    assert first_duplicate([(0, "x"), (1, "z")], {hash("x"), hash("z")}) is None


def test_jsonl_validation_names_the_first_duplicate_line(tmp_path: Path):
    lines = [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
             for i in (0, 1, 2, 1, 0)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with open(path, "rb") as f:
        reader = JsonlInput(f, Limits(), path.stat().st_size)
        with pytest.raises(InputError, match="duplicate custom_id 'row-1' on lines 2 and 4"):
            reader.validate()
