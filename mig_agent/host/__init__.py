"""The host beyond NVML: the commands the agent runs there (hooks, GPU client services)."""
