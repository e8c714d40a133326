"""The refit config block a training framework adopts: whether and how to verify, plus two transport knobs.

As it sits in a framework's YAML (e.g. under ``policy.refit``)::

    refit:
      verify:
        mode: "log"          # off | log | enforce; quote it (YAML 1.1 reads a bare off as false)
      buffer_bytes: 268435456   # staging buffer per bucket, >= 512 (default 256 MiB)
      timeout_s: 60             # how long to wait for a peer before giving up (> 0, at most ~24.8 days)

Only a key that is truly absent takes its default: no ``verify`` key (or no
refit config at all) means ``mode: off``. Everything else that is not exactly
right is an error at construction that names the key, the value and what is
allowed: an explicit ``null``/``false``/``[]``/``""``/``0``, a misspelled
mode (matching is case-sensitive: ``"Enforce"`` is rejected with a
suggestion), an unknown key (with the nearest valid key suggested).

:func:`parse_refit_config` returns a :class:`RefitConfig` or raises
:class:`RefitConfigError` with one plain message. The models themselves
(``VerifyConfig(...)``, ``RefitConfig.model_validate(...)``) raise pydantic's
``ValidationError`` carrying the same messages, so they nest inside a
framework's own pydantic config. Both models are frozen.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from wcviz._errors import WcvizError
from wcviz.refit._packing import ALIGN
from wcviz.refit.verify import MODES

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_TIMEOUT_S",
    "MAX_TIMEOUT_S",
    "MODES",
    "RefitConfig",
    "RefitConfigError",
    "VerifyConfig",
    "check_buffer_bytes",
    "check_timeout",
    "parse_refit_config",
    "verify_mode",
]

DEFAULT_BUFFER_BYTES = 256 * 1024 * 1024
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 2_147_483.0  # seconds: ZMQ's poll takes an int of milliseconds (2**31 - 1), about 24.8 days

_CHOICES = ", ".join(repr(m) for m in MODES)


class RefitConfigError(WcvizError, ValueError):
    """A refit config that is not exactly right; the message names the key, the value and what is allowed."""


def _suggest(word: str, allowed: tuple[str, ...] | list[str]) -> str | None:
    """The allowed word ``word`` most likely meant, or None."""
    folded = word.strip().lower()
    for a in allowed:
        if a.lower() == folded:
            return a
    close = difflib.get_close_matches(folded, [a.lower() for a in allowed], n=1, cutoff=0.6)
    return next((a for a in allowed if close and a.lower() == close[0]), None)


def _check_keys(data: Any, cls: type[BaseModel], where: str) -> dict[str, Any]:
    """``data`` as a plain dict, after rejecting anything that is not a mapping or carries an unknown key."""
    allowed = sorted(cls.model_fields)
    if not isinstance(data, Mapping):
        # ValueError, not TypeError: pydantic collects only ValueErrors into its ValidationError
        raise ValueError(f"{where} must be a mapping of {', '.join(allowed)}; got {data!r}")  # noqa: TRY004
    unknown = []
    for key in data:
        if key not in cls.model_fields:
            hint = _suggest(key, allowed) if isinstance(key, str) else None
            unknown.append(f"unknown key {key!r} in {where}" + (f" (did you mean {hint!r}?)" if hint else ""))
    if unknown:
        raise ValueError("; ".join(unknown) + f"; allowed keys: {', '.join(allowed)}")
    return dict(data)


def check_timeout(value: Any, where: str = "timeout_s") -> float:
    """``value`` as float seconds if it is a finite number > 0 and at most :data:`MAX_TIMEOUT_S`.

    Else :class:`RefitConfigError` (a ValueError) naming ``where``; the config and
    every transport's constructor check their ``timeout_s`` with it.

    A negative timeout would make ZMQ wait forever (a hang, not a timeout); inf,
    NaN and huge values cannot become the milliseconds a poll takes.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S:
        return float(value)
    raise RefitConfigError(
        f"invalid value for {where}: {value!r}; it must be a finite number of seconds > 0 "
        f"and at most {MAX_TIMEOUT_S:.0f} (about 24.8 days)"
    )


def check_buffer_bytes(value: Any, where: str = "buffer_bytes") -> int:
    """``value`` if it is an integer number of bytes >= the 512-byte alignment (not a bool, not a float), else
    :class:`RefitConfigError` (a ValueError) naming ``where``: the config and the simulated cluster check with it."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= ALIGN:
        return value
    raise RefitConfigError(f"invalid value for {where}: {value!r}; it must be an integer number of bytes >= {ALIGN}")


def _check_mode(value: Any) -> str:
    """``value`` if it is one of :data:`MODES` exactly, else a ValueError naming ``verify.mode``."""
    if isinstance(value, str) and value in MODES:
        return value
    if isinstance(value, bool):
        said = "off, no or false" if value is False else "on, yes or true"
        hint = f' (YAML 1.1 reads a bare {said} as {value}: quote the mode, e.g. mode: "off")'
    elif isinstance(value, str) and (s := _suggest(value, MODES)):
        hint = f" (did you mean {s!r}?)"
    else:
        hint = ""
    raise ValueError(f"invalid value for verify.mode: {value!r}{hint}; allowed values: {_CHOICES}")


class VerifyConfig(BaseModel):
    """``verify:`` — ``mode`` is ``off`` (compute and compare nothing), ``log`` (warn per bad parameter) or ``enforce`` (raise)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["off", "log", "enforce"] = "off"

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        return data if isinstance(data, cls) else _check_keys(data, cls, "verify")

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> str:
        return _check_mode(value)


class RefitConfig(BaseModel):
    """A refit config: the ``verify`` block and the transport knobs (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verify: VerifyConfig = VerifyConfig()
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        return data if isinstance(data, cls) else _check_keys(data, cls, "refit config")

    @field_validator("verify", mode="before")
    @classmethod
    def _verify(cls, value: Any) -> Any:
        if isinstance(value, (VerifyConfig, Mapping)):
            return value
        raise ValueError(
            f"invalid value for verify: {value!r}; it must be a mapping such as {{mode: 'log'}} with mode one of "
            f"{_CHOICES} (leave the key out for the default 'off')"
        )

    @field_validator("buffer_bytes", mode="before")
    @classmethod
    def _buffer_bytes(cls, value: Any) -> int:
        return check_buffer_bytes(value)

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _timeout_s(cls, value: Any) -> float:
        return check_timeout(value)


def _message(e: ValidationError) -> str:
    """The messages of a pydantic ``ValidationError`` without its boilerplate, one per line."""
    lines = []
    for err in e.errors(include_url=False):
        cause = (err.get("ctx") or {}).get("error")
        if err["type"] == "value_error" and cause is not None:
            lines.append(str(cause))
        else:  # not raised by our validators (should not happen): still name the key and the value
            path = ".".join(str(p) for p in err["loc"]) or "refit config"
            lines.append(f"invalid value for {path}: {err.get('input')!r}; {err['msg']}")
    return (
        lines[0] if len(lines) == 1 else f"{len(lines)} errors in refit config:\n" + "\n".join(f"- {m}" for m in lines)
    )


def parse_refit_config(data: Mapping[str, Any] | RefitConfig | None) -> RefitConfig:
    """A :class:`RefitConfig` from a framework's refit section (None or ``{}``: every default)."""
    if data is None:
        return RefitConfig()
    if isinstance(data, RefitConfig):
        return data
    try:
        return RefitConfig.model_validate(data)
    except ValidationError as e:
        raise RefitConfigError(_message(e)) from None


def verify_mode(x: str | VerifyConfig | RefitConfig | Any | None) -> str:
    """The verify mode as a plain string, from a mode string, either config, any object with a
    ``.mode``, or None (``"off"``)."""
    if x is None:
        return "off"
    if isinstance(x, RefitConfig):
        return x.verify.mode
    if isinstance(x, VerifyConfig):
        return x.mode
    if not isinstance(x, str) and hasattr(x, "mode"):  # a framework's own config object
        x = x.mode
    try:
        return _check_mode(x)
    except ValueError as e:
        raise RefitConfigError(str(e)) from None
