"""``python -m migsim.nvml --state FILE create|show|reset|reboot|process|fault|counts``."""

from .library import main

raise SystemExit(main())
