"""A kubelet's PodResources server (v1.PodResourcesLister) on a unix socket, for the simulated
kubelet device manager and for tests: the messages and wire constants are the agent's client's
(mig_agent.kube.podresources), so both ends speak the same schema."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any, Final

import grpc

from mig_agent.core.errors import KubeError
from mig_agent.kube.podresources import (
    MAX_MESSAGE_BYTES,
    MESSAGES,
    SERVICE,
    PodKey,
    serialize,
    target,
)

Provider = Callable[[], Mapping[PodKey, Mapping[str, Sequence[str]]]]
AllocatableProvider = Callable[[], Mapping[str, Sequence[str]]]

# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_SOCKET_PATH: Final = 107
# The simulated kubelet allocates per pod (PodView has no containers), so it reports one container.
SIMULATED_CONTAINER: Final = "main"
_ListRequest: Final = MESSAGES["ListPodResourcesRequest"]
_ListResponse: Final = MESSAGES["ListPodResourcesResponse"]
_AllocatableRequest: Final = MESSAGES["AllocatableResourcesRequest"]
_AllocatableResponse: Final = MESSAGES["AllocatableResourcesResponse"]


class Server:
    """A running PodResources server on a unix socket; stop() shuts it down and removes the socket.

    Also a context manager.
    """

    def __init__(self, server: Any, socket_path: str) -> None:
        self._server = server
        self.socket_path = socket_path

    def stop(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def serve(
    socket_path: str,
    provider: Provider,
    *,
    allocatable: AllocatableProvider | None = None,
) -> Server:
    """Serve v1.PodResourcesLister on ``socket_path``, as the kubelet does.

    ``List`` answers from ``provider()``: (namespace, pod) -> {resource name: device ids}, one
    container per pod. ``GetAllocatableResources`` answers from ``allocatable()``: {resource name:
    device ids}, or nothing when not given. Both are called on a gRPC worker thread, once per
    request. A stale socket file is replaced. Raises KubeError when the socket cannot be bound.
    """
    path = os.path.abspath(socket_path)
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise KubeError(
            f"pod resources socket path {path} is longer than {_MAX_SOCKET_PATH} bytes",
            socket=path,
        )
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)  # left by a server that did not stop cleanly, as the kubelet does

    def list_(_request: Any, _context: Any) -> Any:
        out = _ListResponse()
        for (namespace, name), resources in provider().items():
            pod = out.pod_resources.add(name=name, namespace=namespace)
            container = pod.containers.add(name=SIMULATED_CONTAINER)
            for resource, ids in resources.items():
                container.devices.add(resource_name=resource, device_ids=list(ids))
        return out

    def allocatable_(_request: Any, _context: Any) -> Any:
        out = _AllocatableResponse()
        for resource, ids in (allocatable() if allocatable else {}).items():
            out.devices.add(resource_name=resource, device_ids=list(ids))
        return out

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "List": grpc.unary_unary_rpc_method_handler(
                list_,
                request_deserializer=_ListRequest.FromString,
                response_serializer=serialize,
            ),
            "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                allocatable_,
                request_deserializer=_AllocatableRequest.FromString,
                response_serializer=serialize,
            ),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="podresources"),
        handlers=(handler,),
        options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    try:
        bound = server.add_insecure_port(target(path))
    except RuntimeError as exc:  # grpc >= 1.50 raises instead of returning 0
        raise KubeError(f"bind pod resources socket {path}: {exc}", socket=path) from exc
    if not bound:
        raise KubeError(f"bind pod resources socket {path}: refused", socket=path)
    server.start()
    return Server(server, path)
