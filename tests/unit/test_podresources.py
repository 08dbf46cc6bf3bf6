"""We test these aspects of the kubelet PodResources client and server
(mig_agent.kube.podresources):

* a List round trip over a unix socket: only GPU resources (nvidia.com/gpu, nvidia.com/mig-*) come
  back, per (namespace, pod); pods without GPU devices are left out; replica suffixes are cut;
* the wire format is api.proto's: bytes built by hand from the field numbers are what the server
  sends and what the client decodes, including several containers and fields we do not declare
  (cpu_ids, memory, topology), as a real kubelet sends them;
* GetAllocatableResources round trip;
* failures name the socket: missing, not a socket, nobody listening; a stale socket is replaced.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from migsim import podresources_server

from mig_agent.core.errors import KubeError, KubeUnavailable
from mig_agent.kube import podresources

LIST = "/v1.PodResourcesLister/List"

# -- protobuf wire format by hand (https://protobuf.dev/programming-guides/encoding/) ---------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, payload: bytes | str) -> bytes:
    """A length-delimited field (wire type 2): strings and embedded messages."""
    data = payload.encode() if isinstance(payload, str) else payload
    return varint(number << 3 | 2) + varint(len(data)) + data


def container_devices(resource: str, *ids: str, numa: int | None = None) -> bytes:
    # ContainerDevices { string resource_name = 1; repeated string device_ids = 2;
    #                    TopologyInfo topology = 3 }   TopologyInfo { repeated NUMANode nodes = 1 }
    # NUMANode { int64 ID = 1 }
    out = field(1, resource) + b"".join(field(2, i) for i in ids)
    if numa is not None:
        out += field(3, field(1, varint(1 << 3 | 0) + varint(numa)))
    return out


def container(name: str, *devices: bytes, cpu_ids: tuple[int, ...] = ()) -> bytes:
    # ContainerResources { string name = 1; repeated ContainerDevices devices = 2;
    #                      repeated int64 cpu_ids = 3 (packed);
    #                      repeated ContainerMemory memory = 4 }
    out = field(1, name) + b"".join(field(2, d) for d in devices)
    if cpu_ids:
        out += field(3, b"".join(varint(c) for c in cpu_ids))
        # ContainerMemory { string memory_type = 1; uint64 size = 2 }
        out += field(4, field(1, "memory") + varint(2 << 3 | 0) + varint(1 << 30))
    return out


def pod(namespace: str, name: str, *containers: bytes) -> bytes:
    # PodResources { string name = 1; string namespace = 2; repeated ContainerResources = 3 }
    return field(1, name) + field(2, namespace) + b"".join(field(3, c) for c in containers)


def list_response(*pods: bytes) -> bytes:
    # ListPodResourcesResponse { repeated PodResources pod_resources = 1 }
    return b"".join(field(1, p) for p in pods)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def sock(tmp_path: Path) -> str:
    return str(tmp_path / "kubelet.sock")


@pytest.fixture
def raw_kubelet(sock: str) -> Iterator[Callable[[bytes], None]]:
    """A stand-in kubelet that answers List with the given bytes, encoded by nobody but the test."""
    answer: list[bytes] = [b""]
    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister",
        {
            "List": grpc.unary_unary_rpc_method_handler(
                lambda _req, _ctx: answer[0],
                request_deserializer=lambda b: b,
                response_serializer=lambda b: b,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), handlers=(handler,))
    assert server.add_insecure_port(f"unix:{sock}")
    server.start()
    yield lambda data: answer.__setitem__(0, data)
    server.stop(None).wait()


def raw_list(sock: str) -> bytes:
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        data: bytes = channel.unary_unary(
            LIST, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )(b"", timeout=5)
    return data


# -- round trip -------------------------------------------------------------------------------


def test_list_round_trip_returns_only_gpu_devices(sock: str) -> None:
    pods = {
        ("ml", "train"): {
            "nvidia.com/mig-3g.40gb": ["MIG-aaaa", "MIG-bbbb"],
            "nvidia.com/gpu": ["GPU-1111"],
            "example.com/nic": ["nic0"],
        },
        ("ml", "web"): {"example.com/nic": ["nic1"]},
        ("batch", "infer"): {"nvidia.com/gpu": ["GPU-2222::3"]},  # a time-slicing replica
        ("batch", "idle"): {},
    }
    with podresources_server.serve(sock, lambda: pods):
        got = podresources.list_pod_devices(sock)
    assert got == {
        ("ml", "train"): frozenset({"MIG-aaaa", "MIG-bbbb", "GPU-1111"}),
        ("batch", "infer"): frozenset({"GPU-2222"}),
    }


def test_list_sees_what_the_provider_says_now(sock: str) -> None:
    now: dict[tuple[str, str], dict[str, list[str]]] = {}
    with podresources_server.serve(sock, lambda: now):
        assert podresources.list_pod_devices(sock) == {}
        now[("ns", "p")] = {"nvidia.com/mig-1g.10gb": ["MIG-1"]}
        assert podresources.list_pod_devices(sock) == {("ns", "p"): frozenset({"MIG-1"})}


def test_allocatable_round_trip_returns_only_gpu_devices(sock: str) -> None:
    allocatable = {
        "nvidia.com/mig-1g.10gb": ["MIG-1", "MIG-2"],
        "nvidia.com/gpu": ["GPU-3"],
        "example.com/nic": ["nic0"],
    }
    with podresources_server.serve(sock, dict, allocatable=lambda: allocatable):
        assert podresources.list_allocatable_devices(sock) == {
            "nvidia.com/mig-1g.10gb": {"MIG-1", "MIG-2"},
            "nvidia.com/gpu": {"GPU-3"},
        }
    with podresources_server.serve(sock, dict):
        assert podresources.list_allocatable_devices(sock) == {}


# -- wire format ------------------------------------------------------------------------------


def test_server_sends_api_proto_bytes(sock: str) -> None:
    pods = {
        ("ml", "train"): {
            "nvidia.com/mig-3g.40gb": ["MIG-a", "MIG-b"],
            "nvidia.com/gpu": ["GPU-1"],
        },
        ("ml", "web"): {},
    }
    c = podresources_server.SIMULATED_CONTAINER
    expected = list_response(
        pod(
            "ml",
            "train",
            container(
                c,
                container_devices("nvidia.com/mig-3g.40gb", "MIG-a", "MIG-b"),
                container_devices("nvidia.com/gpu", "GPU-1"),
            ),
        ),
        pod("ml", "web", container(c)),
    )
    with podresources_server.serve(sock, lambda: pods):
        assert raw_list(sock) == expected


def test_client_decodes_kubelet_bytes_with_containers_and_undeclared_fields(
    sock: str, raw_kubelet: Callable[[bytes], None]
) -> None:
    raw_kubelet(
        list_response(
            pod(
                "ml",
                "train",
                container("init", container_devices("nvidia.com/gpu", "GPU-0", numa=0)),
                container(
                    "main",
                    container_devices("nvidia.com/mig-1g.10gb", "MIG-1", numa=1),
                    container_devices("example.com/nic", "nic0"),
                    cpu_ids=(2, 3, 200),
                ),
                container("sidecar", container_devices("nvidia.com/mig-1g.10gb", "MIG-2")),
            ),
            pod("ml", "cpu-only", container("main", cpu_ids=(1,))),
            pod("other", "train", container("main", container_devices("nvidia.com/gpu", "GPU-9"))),
        )
    )
    assert podresources.list_pod_devices(sock) == {
        ("ml", "train"): frozenset({"GPU-0", "MIG-1", "MIG-2"}),
        ("other", "train"): frozenset({"GPU-9"}),
    }


def test_client_rejects_bytes_that_are_not_a_response(
    sock: str, raw_kubelet: Callable[[bytes], None]
) -> None:
    raw_kubelet(b"\x0a\xff")  # field 1, length 255, then nothing
    with pytest.raises(KubeUnavailable, match=sock):
        podresources.list_pod_devices(sock)


# -- failures ---------------------------------------------------------------------------------


def test_missing_socket_raises_kube_unavailable_naming_it(sock: str) -> None:
    with pytest.raises(KubeUnavailable, match=f"{sock}: no socket") as err:
        podresources.list_pod_devices(sock)
    assert err.value.context["socket"] == sock
    assert err.value.retryable


def test_a_file_that_is_not_a_socket_is_refused(sock: str) -> None:
    Path(sock).write_text("")
    with pytest.raises(KubeUnavailable, match=f"{sock}: not a socket"):
        podresources.list_pod_devices(sock)


def test_socket_nobody_listens_on_raises_kube_unavailable(sock: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(sock)  # bound, never listening: what a dead kubelet leaves behind
        with pytest.raises(KubeUnavailable, match=f"{sock}: UNAVAILABLE") as err:
            podresources.list_pod_devices(sock, timeout_s=2)
    assert err.value.context["grpc_code"] == "UNAVAILABLE"


def test_serve_replaces_a_stale_socket_and_removes_it_on_stop(sock: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(sock)
    server = podresources_server.serve(sock, lambda: {("a", "b"): {"nvidia.com/gpu": ["GPU-1"]}})
    assert podresources.list_pod_devices(sock) == {("a", "b"): frozenset({"GPU-1"})}
    server.stop()
    assert not Path(sock).exists()


def test_serve_refuses_a_socket_path_too_long_for_unix_sockets(tmp_path: Path) -> None:
    with pytest.raises(KubeError, match="longer than"):
        podresources_server.serve(str(tmp_path / ("x" * 120)), dict)
