"""Glue that runs inside another framework's processes (a vLLM worker, ...).

Each integration lives in its own module and imports its framework lazily, so
importing this package costs nothing: ``from wcviz.integrations.vllm import
WcvizWorkerExtension``.
"""

from __future__ import annotations

__all__: list[str] = []
