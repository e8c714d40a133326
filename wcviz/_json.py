"""JSON that remembers keys given twice: plain ``json`` keeps the last one silently, and a table that names a
column twice, or a header that names a tensor twice, must be refused rather than half read."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["first_repeated", "loads", "repeated"]


class _Object(dict):  # type: ignore[type-arg]
    """A JSON object as :func:`loads` parses it: ``repeated`` holds the keys it was given more than once."""

    repeated: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        counts: dict[str, int] = {}
        for k, _ in pairs:
            counts[k] = counts.get(k, 0) + 1
        obj.repeated = tuple(k for k, n in counts.items() if n > 1)
    return obj


def loads(raw: bytes | str) -> Any:
    """``json.loads`` whose objects remember the keys they were given more than once (see :func:`repeated`)."""
    return json.loads(raw, object_pairs_hook=_object)


def repeated(value: Any) -> tuple[str, ...]:
    """The keys a JSON object from :func:`loads` was given more than once (none for anything else)."""
    return value.repeated if isinstance(value, _Object) else ()


def first_repeated(value: Any) -> str | None:
    """The first key repeated in any object nested in ``value`` (iteratively: a deep value is no RecursionError)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if repeated(v):
                return repeated(v)[0]
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None
