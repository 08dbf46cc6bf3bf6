"""Shared fixtures; those for tests against a real local cluster (marker `cluster`).

One cluster serves the whole test session: started by `cluster` in a temp folder and stopped at the
end, or, when `MIG_AGENT_TEST_CLUSTER_DIR` names a folder with a running cluster (`eval
$(scripts/local-cluster env)`), that one is used and left running. Each test gets a fresh namespace
and factories for GPU nodes, GPU pods and ServiceAccount kubeconfigs; what a test creates is removed
after it.

The binaries must have been built (`scripts/k8s-binaries build`); without them the `cluster` fixture
fails rather than skips, so that a CI run that forgot to build them cannot pass by testing nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest
from kubernetes import client, config
from migsim.cluster import (
    DEFAULT_GPUS,
    SIMULATED_IMAGE,
    BinariesMissing,
    Cluster,
    ClusterNotRunning,
    find_binaries,
    wait_until,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cluster: runs against the local Kubernetes cluster (needs scripts/k8s-binaries build)",
    )


# Folders by what they cost, dearest first: parallel workers (scripts/test runs pytest-xdist)
# take a module, or a group, at a time in this order, so the long waits start early and the real
# node's quarter of an hour does not begin when everything else is done.
_FIRST = ("kubelet", "e2e", "faults", "cluster", "native", "gpu", "packaging", "unit")
# Folders whose tests must all run on one worker, one after the other: the real node owns this
# machine's /var/lib/kubelet, containerd's socket and the kubelet's ports.
_ONE_WORKER = ("kubelet",)


def _folder(item: pytest.Item) -> str:
    parts = Path(str(item.path)).relative_to(Path(__file__).parent).parts
    return parts[0] if len(parts) > 1 else ""


def _rank(item: pytest.Item) -> int:
    folder = _folder(item)
    return _FIRST.index(folder) if folder in _FIRST else len(_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test in tests/cluster, tests/e2e and tests/kubelet needs the cluster; marking them
    # here lets `-m "not cluster"` skip those folders without each module remembering the marker.
    for item in items:
        if _folder(item) in ("cluster", "e2e", "kubelet"):
            item.add_marker(pytest.mark.cluster)
    items.sort(key=_rank)  # stable: each folder keeps its own order


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent when it is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Work handed out a module at a time (its tests share its fixtures), a folder of
    _ONE_WORKER at a time; in collection order, which is dearest first."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            parts = module.split("/")
            if len(parts) > 2 and parts[0] == "tests" and parts[1] in _ONE_WORKER:
                return "/".join(parts[:2])
            return module

    config.option.loadscopereorder = False  # keep the dearest-first order
    return ByModule(config, log)


NVIDIA_RUNTIME_CLASS = {
    "apiVersion": "node.k8s.io/v1",
    "kind": "RuntimeClass",
    "metadata": {"name": "nvidia"},
    "handler": "nvidia",
}


def add_nvidia_runtime_class(cluster: Cluster) -> None:
    """The RuntimeClass the GPU Operator creates: the agent's DaemonSet runs under it
    (runtimeClassName: nvidia), and without it the API server admits none of its pods."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps(NVIDIA_RUNTIME_CLASS))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The session's cluster: 2 GPU nodes (gpu-node-0, gpu-node-1, 8xH100-80GB each)."""
    named = os.environ.get("MIG_AGENT_TEST_CLUSTER_DIR")
    if named:
        try:
            attached = Cluster.attach(Path(named))  # someone else's cluster: not ours to stop
            add_nvidia_runtime_class(attached)
            yield attached
            return
        except ClusterNotRunning:
            directory = Path(named)
    else:
        directory = tmp_path_factory.mktemp("cluster")
    try:
        find_binaries()
        missing = ""
    except BinariesMissing as e:
        missing = str(e)
    if missing:  # failed outside the except block, so the report is this one line
        pytest.fail(missing, pytrace=False)
    started = Cluster.up(directory, gpu_nodes=2, gpus=DEFAULT_GPUS)
    add_nvidia_runtime_class(started)
    try:
        yield started
    finally:
        started.down()


@pytest.fixture(scope="session")
def api_client(cluster: Cluster) -> Iterator[client.ApiClient]:
    """A `kubernetes` client acting as the cluster admin."""
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        yield api
    finally:
        api.close()


@pytest.fixture(scope="session")
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


_counter = itertools.count()


def _dns_label(text: str, limit: int) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].rstrip("-")


@pytest.fixture
def namespace(
    request: pytest.FixtureRequest, cluster: Cluster, core: client.CoreV1Api
) -> Iterator[str]:
    """A fresh namespace named after the test; deleted (without waiting) afterwards."""
    name = f"t{next(_counter)}-{_dns_label(request.node.name, 50)}"
    core.create_namespace({"metadata": {"name": name}})

    # The ServiceAccount admission plugin refuses pods until KCM has created the namespace's
    # `default` ServiceAccount; it takes milliseconds, but a test that creates a pod at once would
    # otherwise race it.
    def default_sa() -> bool:
        try:
            core.read_namespaced_service_account("default", name)
        except client.ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    wait_until(default_sa, timeout=30, what=f"ServiceAccount {name}/default")
    try:
        yield name
    finally:
        core.delete_namespace(name)


class GpuNodeFactory(Protocol):
    def __call__(
        self,
        gpus: str = DEFAULT_GPUS,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
    ) -> str: ...


@pytest.fixture
def gpu_node_factory(cluster: Cluster) -> Iterator[GpuNodeFactory]:
    """Creates a simulated GPU node (`gpus` like "8xH200"), waits until schedulable; its name.

    The nodes are deleted after the test.
    """
    created: list[str] = []

    def make(
        gpus: str = DEFAULT_GPUS,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
    ) -> str:
        name = f"gpu-test-{next(_counter)}"
        created.append(name)
        return cluster.add_gpu_node(name, gpus, labels=labels, taints=taints)

    yield make
    for name in created:
        cluster.delete_node(name)


class GpuPodFactory(Protocol):
    def __call__(
        self,
        namespace: str,
        name: str,
        *,
        resources: Mapping[str, int | str] | None = None,
        node: str | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        grace_period: int = 30,
    ) -> Any: ...


@pytest.fixture
def gpu_pod(core: client.CoreV1Api) -> GpuPodFactory:
    """Creates a pod asking for GPU resources (default `nvidia.com/gpu: 1`); returns the V1Pod.

    `node` pins it with a nodeSelector on the hostname (the scheduler still checks resources).
    """

    def make(
        namespace: str,
        name: str,
        *,
        resources: Mapping[str, int | str] | None = None,
        node: str | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        grace_period: int = 30,
    ) -> Any:
        limits = {k: str(v) for k, v in (resources or {"nvidia.com/gpu": 1}).items()}
        spec: dict[str, Any] = {
            "terminationGracePeriodSeconds": grace_period,
            "containers": [
                {
                    "name": "cuda",
                    "image": SIMULATED_IMAGE,
                    "resources": {"limits": limits, "requests": limits},
                }
            ],
        }
        if node is not None:
            spec["nodeSelector"] = {"kubernetes.io/hostname": node}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": dict(labels or {}),
                "annotations": dict(annotations or {}),
            },
            "spec": spec,
        }
        return core.create_namespaced_pod(namespace, body)

    return make


class SaKubeconfig(Protocol):
    def __call__(self, namespace: str, name: str) -> Path: ...


@pytest.fixture
def sa_kubeconfig(cluster: Cluster, core: client.CoreV1Api, tmp_path: Path) -> SaKubeconfig:
    """`sa_kubeconfig(namespace, name)`: a kubeconfig file acting as that ServiceAccount.

    The ServiceAccount is created if missing; its rights are whatever RBAC grants it, so code under
    test that is handed this file runs with exactly that account's permissions.
    """

    def make(namespace: str, name: str) -> Path:
        try:
            core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
        except client.ApiException as e:
            if e.status != 409:
                raise
        return cluster.kubeconfig_for(namespace, name, tmp_path / f"{namespace}-{name}.kubeconfig")

    return make
