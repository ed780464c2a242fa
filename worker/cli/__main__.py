"""`python -m worker.cli`: the `thumbq` command."""

from __future__ import annotations

import sys

from worker.cli import main

sys.exit(main())
