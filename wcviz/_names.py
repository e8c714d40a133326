"""Parameter-name filters that run in bounded time, whatever the pattern a request carries.

Agents run inside engines and trainers, and ``GET /v1/digests?name=...`` comes from
anyone who can reach them. Python's ``re`` backtracks: a pattern such as
``^(\\w+\\.?)+\\.$`` takes exponential time on a long name, and it holds the GIL while it
does, so every thread of the host process stops. Name filters are therefore RE2
regular expressions (``google-re2``): linear in the name, no backreferences or
lookaround, a bounded compile, and a pattern of at most :data:`MAX_PATTERN`
characters. Everything that filters names by a user's pattern (the agent, the
vLLM worker extension, the CLI, the clients that send patterns) goes through here.
"""

from __future__ import annotations

from collections.abc import Callable

from wcviz._errors import WcvizError

__all__ = ["MAX_PATTERN", "NameFilterError", "name_filter"]

MAX_PATTERN = 512  # characters; real filters are a few words
_MAX_MEM = 8 << 20  # bytes RE2 may use to compile one pattern


class NameFilterError(WcvizError, ValueError):
    """A name filter that is not a valid pattern (or too long); the message quotes it and says why."""


def _shown(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


def name_filter(pattern: str | None) -> Callable[[str], bool] | None:
    """A predicate that is True for names the RE2 ``pattern`` finds a match in (``search``), or None for no filter.

    Raises :class:`NameFilterError` for a pattern that is not a string, longer than
    :data:`MAX_PATTERN` characters, or not valid RE2 syntax (which has no
    backreferences and no lookaround).
    """
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise NameFilterError(f"a name filter is a regular expression string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN:
        raise NameFilterError(f"name filter {_shown(pattern)} is {len(pattern):,} characters; the limit is {MAX_PATTERN}")
    import re2

    options = re2.Options()
    options.log_errors = False
    options.never_capture = True
    options.max_mem = _MAX_MEM
    try:
        compiled = re2.compile(pattern, options)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise NameFilterError(
            f"bad name filter {_shown(pattern)}: {why} (an RE2 regular expression: no backreferences or lookaround)"
        ) from None
    search = compiled.search

    def matches(name: str) -> bool:
        return search(name) is not None

    return matches
