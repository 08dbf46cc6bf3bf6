"""A node's changes as a Kubernetes watch tells them, for the tests that must see a state the node
passes through: a poll sees the node as it is when it looks, and misses a state that lasts less
than its interval (a `rebooting` of a few milliseconds, on a loaded machine); a watch opened at
the resourceVersion of a read is told every change made after that read, in order."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch

GONE = 410  # the resourceVersion watched from is compacted away: read the node again


def node_versions(core: client.CoreV1Api, name: str, timeout: float) -> Iterator[Any]:
    """Node ``name`` (a V1Node) as read now, then as each change made after that read left it,
    in order, until ``timeout`` seconds have passed: the iterator then ends, and the caller says
    what it waited for. A watch that ends (the API server's timeoutSeconds, a dropped
    connection) is opened again from the last resourceVersion seen, so no change is missed; one
    answered 410 Gone starts over from a new read."""
    deadline = time.monotonic() + timeout
    selector = f"metadata.name={name}"
    version: str | None = None
    while (left := deadline - time.monotonic()) > 0:
        if version is None:
            listed = core.list_node(field_selector=selector)
            version = listed.metadata.resource_version
            yield from listed.items
            continue
        events = watch.Watch().stream(
            core.list_node,
            field_selector=selector,
            resource_version=version,
            timeout_seconds=max(1, math.ceil(left)),
            _request_timeout=left + 10,  # a connection that died unnoticed ends too
        )
        try:
            for event in events:
                if event["type"] in ("ADDED", "MODIFIED"):
                    version = event["object"].metadata.resource_version
                    yield event["object"]
                    if time.monotonic() > deadline:
                        return
        except client.ApiException as e:
            if e.status != GONE:
                raise
            version = None
        except (urllib3.exceptions.ProtocolError, urllib3.exceptions.ReadTimeoutError):
            pass  # the watch's connection ended: watch again from `version`
        finally:
            events.close()


@contextlib.contextmanager
def core_for(kubeconfig: Path) -> Iterator[client.CoreV1Api]:
    """A CoreV1Api acting as ``kubeconfig`` says, closed when the block ends."""
    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        yield client.CoreV1Api(api)
    finally:
        api.close()
