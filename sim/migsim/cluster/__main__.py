"""``python -m migsim.cluster`` is ``scripts/local-cluster``."""

from .cli import main

raise SystemExit(main())
