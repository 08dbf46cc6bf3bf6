"""``python -m mig_agent.devcluster`` is ``scripts/local-cluster``."""

from .cli import main

raise SystemExit(main())
