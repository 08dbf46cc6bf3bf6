"""The simulated kubelet device manager (migsim.kubelet) against a device plugin written here with
the same v1beta1 messages: the real plugin's side is tested in test_device_plugin.py.

We test these aspects: a plugin that registers is dialled back on its endpoint, its options and
every ListAndWatch update are taken (capacity counts every device, allocatable the healthy ones);
a re-registration replaces the plugin; another API version is refused with an error the plugin
sees; Allocate reaches the plugin with the device ids and returns its environment; a plugin that
goes keeps its devices, unhealthy, for the stop grace period, then its resource goes; the command
line runs a plugin command and reports what it saw, also when the plugin exits at once."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from migsim.kubelet import DEVICE_PLUGIN, MESSAGES, REGISTRATION, DeviceManager

Update = list[tuple[str, str]] | None  # (id, health) per device; None ends the stream


class FakePlugin:
    """A device plugin serving one resource on ``<dir>/<endpoint>``."""

    def __init__(self, plugin_dir: Path, endpoint: str) -> None:
        self.updates: queue.Queue[Update] = queue.Queue()
        self.allocated: list[list[str]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        ser = lambda m: m.SerializeToString()  # noqa: E731
        handlers = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                lambda _r, _c: MESSAGES["DevicePluginOptions"](pre_start_required=True),
                request_deserializer=MESSAGES["Empty"].FromString,
                response_serializer=ser,
            ),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self._list_and_watch,
                request_deserializer=MESSAGES["Empty"].FromString,
                response_serializer=ser,
            ),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                self._allocate,
                request_deserializer=MESSAGES["AllocateRequest"].FromString,
                response_serializer=ser,
            ),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(DEVICE_PLUGIN, handlers),)
        )
        self.server.add_insecure_port(f"unix://{plugin_dir / endpoint}")
        self.server.start()

    def _list_and_watch(self, _request: Any, _context: Any) -> Iterator[Any]:
        while (devices := self.updates.get()) is not None:
            response = MESSAGES["ListAndWatchResponse"]()
            for i, health in devices:
                d = response.devices.add(ID=i, health=health)
                d.topology.nodes.add(ID=0)
            yield response

    def _allocate(self, request: Any, _context: Any) -> Any:
        response = MESSAGES["AllocateResponse"]()
        for c in request.container_requests:
            self.allocated.append(list(c.devices_ids))
            response.container_responses.add().envs["VISIBLE"] = ",".join(c.devices_ids)
        return response

    def stop(self) -> None:
        self.updates.put(None)
        self.server.stop(0).wait()


def register(plugin_dir: Path, resource: str, endpoint: str, version: str = "v1beta1") -> None:
    with grpc.insecure_channel(f"unix://{plugin_dir / 'kubelet.sock'}") as channel:
        call = channel.unary_unary(
            f"/{REGISTRATION}/Register",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=MESSAGES["Empty"].FromString,
        )
        call(
            MESSAGES["RegisterRequest"](version=version, endpoint=endpoint, resource_name=resource),
            timeout=5,
        )


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    d = tmp_path / "dp"  # unix socket paths are short
    d.mkdir()
    return d


def test_registration_list_and_watch_and_allocate(plugin_dir: Path) -> None:
    plugin = FakePlugin(plugin_dir, "fake.sock")
    with DeviceManager(str(plugin_dir)) as kubelet:
        assert (plugin_dir / "kubelet.sock").exists()
        plugin.updates.put([("a", "Healthy"), ("b", "Healthy"), ("c", "Healthy")])
        register(plugin_dir, "example.com/thing", "fake.sock")
        assert kubelet.wait_for_resources(1, timeout_s=10, settle_s=0.2)
        assert kubelet.capacity() == {"example.com/thing": 3}
        report = kubelet.report()["plugins"]["example.com/thing"]
        assert report["options"]["pre_start_required"] is True
        assert report["numa"] == {"a": [0], "b": [0], "c": [0]}

        plugin.updates.put([("a", "Healthy"), ("b", "Unhealthy"), ("c", "Healthy")])
        assert kubelet.wait_for_resources(1, timeout_s=10, settle_s=0.5)
        assert kubelet.report()["plugins"]["example.com/thing"]["updates"] == 2
        assert kubelet.capacity() == {"example.com/thing": 3}
        assert kubelet.allocatable() == {"example.com/thing": 2}

        assert kubelet.allocate("example.com/thing", ["a", "c"]) == {"VISIBLE": "a,c"}
        assert plugin.allocated == [["a", "c"]]
        plugin.stop()
    assert not (plugin_dir / "kubelet.sock").exists()


def test_reregistration_replaces_and_other_versions_are_refused(plugin_dir: Path) -> None:
    first, second = FakePlugin(plugin_dir, "one.sock"), FakePlugin(plugin_dir, "two.sock")
    with DeviceManager(str(plugin_dir)) as kubelet:
        with pytest.raises(grpc.RpcError) as refused:
            register(plugin_dir, "example.com/thing", "one.sock", version="v1alpha")
        assert "unsupported API version" in str(refused.value.details())
        assert kubelet.report()["plugins"] == {}
        first.updates.put([("a", "Healthy")])
        register(plugin_dir, "example.com/thing", "one.sock")
        assert kubelet.wait_for_resources(1, timeout_s=10, settle_s=0.2)
        second.updates.put([("x", "Healthy"), ("y", "Healthy")])
        register(plugin_dir, "example.com/thing", "two.sock")
        assert kubelet.wait_for_resources(1, timeout_s=10, settle_s=0.5)
        assert kubelet.capacity() == {"example.com/thing": 2}
        assert kubelet.report()["refused"] == [
            "example.com/thing: unsupported API version 'v1alpha'"
        ]
    first.stop()
    second.stop()


def test_command_line_reports_a_plugin_that_exits(plugin_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "migsim.kubelet",
            "--dir",
            str(plugin_dir),
            "--report",
            str(report),
            "--timeout",
            "20",
            "--",
            sys.executable,
            "-c",
            "raise SystemExit(3)",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(report.read_text())
    assert seen["plugins"] == {} and seen["complete"] is False
    assert seen["plugin_exit"] == 3


def test_a_stopped_plugin_keeps_its_devices_unhealthy_until_the_grace_period_ends(
    plugin_dir: Path,
) -> None:
    """As the kubelet does when a plugin goes (its stream ends): capacity stays, allocatable is 0,
    until the plugin registers again or the stop grace period passes; then the resource goes."""
    plugin = FakePlugin(plugin_dir, "fake.sock")
    with DeviceManager(str(plugin_dir), stop_grace_s=1.5) as kubelet:
        plugin.updates.put([("a", "Healthy"), ("b", "Healthy")])
        register(plugin_dir, "example.com/thing", "fake.sock")
        assert kubelet.wait_for_resources(1, timeout_s=10, settle_s=0.2)
        assert kubelet.expires_in() is None
        plugin.stop()
        deadline = time.monotonic() + 10
        while kubelet.allocatable() != {"example.com/thing": 0}:
            assert time.monotonic() < deadline, kubelet.report()
            time.sleep(0.05)
        assert kubelet.capacity() == {"example.com/thing": 2}
        assert kubelet.devices() == {"example.com/thing": {"a": "Unhealthy", "b": "Unhealthy"}}
        left = kubelet.expires_in()
        assert left is not None and 0 < left <= 1.5
        time.sleep(left + 0.1)
        assert kubelet.capacity() == {} and kubelet.devices() == {}
        # a plugin that comes back is taken again
        again = FakePlugin(plugin_dir, "again.sock")
        again.updates.put([("c", "Healthy")])
        register(plugin_dir, "example.com/thing", "again.sock")
        assert kubelet.wait_for_resources(1, timeout_s=10, settle_s=0.2)
        assert kubelet.allocatable() == {"example.com/thing": 1}
        again.stop()
