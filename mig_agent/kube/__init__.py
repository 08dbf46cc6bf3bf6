"""The Kubernetes boundary: a Cluster protocol, its API-server implementation, an in-memory fake."""
