"""The node engine, below the agent and the CLI: applying a plan to the GPUs (with the site's
hooks around it), draining the node's GPU pods, and the waits and clock they share."""
