"""What the agent tells about itself: Prometheus metrics, the health endpoints and logging."""
