"""Write kubeconfig files that authenticate with a bearer token.

The files are JSON, which is valid YAML: kubectl, client-go and the `kubernetes` Python client all
read them, and writing them needs no YAML library. The CA is embedded (not referenced by path) so a
kubeconfig still works when copied elsewhere, e.g. into a container or a test's temp folder.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path


def write(
    path: Path,
    *,
    server: str,
    ca_cert: Path,
    user: str,
    token: str,
    namespace: str | None = None,
    cluster: str = "mig-agent-dev",
) -> Path:
    """Write a one-context kubeconfig for `user` (a token) at `path`, readable by the owner only."""
    context: dict[str, str] = {"cluster": cluster, "user": user}
    if namespace is not None:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_cert.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": context}],
        "current-context": user,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created 0600 from the start: the token is a credential, so it is never world-readable, not
    # even for the moment between creating the file and a chmod.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return path
