"""``python -m mig_agent`` runs the CLI."""

from mig_agent.cli import main

raise SystemExit(main())
