"""``python -m wcviz`` runs the CLI."""

from __future__ import annotations

import sys

from wcviz.cli import main

sys.exit(main())
