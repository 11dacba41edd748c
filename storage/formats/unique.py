"""`custom_id` uniqueness over a streamed input in 8 bytes a row: the first pass keeps each id's 64-bit hash (not
the id); only when hashes repeat does a second pass compare those ids by value (a million-row input needs 8 MB,
not the hundreds a set of its ids would)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable


class HashedIds:
    def __init__(self) -> None:
        self._hashes = array("q")

    def add(self, custom_id: str) -> None:
        self._hashes.append(hash(custom_id))

    def repeated_hashes(self) -> set[int]:
        """The hashes seen more than once (empty when every id is unique, the usual case)."""
        import numpy as np

        if not self._hashes:
            return set()
        values = np.frombuffer(self._hashes, dtype=np.int64)
        values.sort()  # in place: the hashes are not needed in their order again
        return set(values[1:][values[1:] == values[:-1]].tolist())


def first_duplicate(ids: Iterable[tuple[int, str | None]], suspects: set[int]) -> tuple[str, int, int] | None:
    """(custom_id, its first position, the position that repeats it) of the earliest repeat among `ids` (position,
    id) whose hash is one of `suspects`; None when they only shared a hash."""
    seen: dict[str, int] = {}
    for position, custom_id in ids:
        if custom_id is not None and hash(custom_id) in suspects:
            first = seen.setdefault(custom_id, position)
            if first != position:
                return custom_id, first, position
    return None
