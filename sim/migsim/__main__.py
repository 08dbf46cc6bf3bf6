"""``python -m migsim``: the simulated world's node-level commands."""

from .cli import main

raise SystemExit(main())
