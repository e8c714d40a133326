"""Deprecated: the end-state check over HTTP agents moved to :mod:`wcviz.endstate`.

``wcviz.check.check_agents``, ``EndStateSession``, ``EndStateReport`` and
``PROBLEM_COLUMNS`` are the same objects as ``wcviz.endstate``'s; import them from
there. This module goes away in a later release (CHANGELOG.md).
"""

from __future__ import annotations

import warnings

from wcviz.endstate import PROBLEM_COLUMNS, EndStateReport, EndStateSession, check_agents

__all__ = ["PROBLEM_COLUMNS", "EndStateReport", "EndStateSession", "check_agents"]

warnings.warn("wcviz.check is deprecated: import from wcviz.endstate", DeprecationWarning, stacklevel=2)
