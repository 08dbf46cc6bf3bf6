"""We test these aspects of the agent's metrics
(`mig_agent.observability.metrics`) and its HTTP endpoints
(`mig_agent.observability.health`):

* every metric family: its name (prefix `mig_agent_`, `_seconds` for durations and timestamps),
  type, help text and label names, read with `registry.collect()`;
* the text exposition: counters as `<name>_total`, histograms with `_bucket`/`_sum`/`_count`, no
  `_created` series, and it parses back with prometheus_client's own parser;
* label values stay bounded: the state gauge has one series per state (one of them 1), the
  layout label keeps at most `MAX_LAYOUTS` values and counts the rest as "other", the device gauge
  drops GPUs and profiles that are gone;
* the phase timer records a duration even when the phase raises;
* `InstrumentedGpus` counts each call by name and each GpuError by name, and passes results and
  exceptions through unchanged;
* `HealthServer` serves /metrics (text format by default, OpenMetrics when asked), answers
  /healthz and /readyz with 200 "ok" or 503 and the reason (also when a check raises), and 404
  for anything else.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mig_agent.core.errors import GpuError
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.placement import Placement
from mig_agent.observability.health import HealthServer
from mig_agent.observability.metrics import (
    MAX_LAYOUTS,
    OTHER_LAYOUT,
    STATES,
    InstrumentedGpus,
    Metrics,
)

from .fake_gpus import FakeGpus

EXPECTED = {
    # name: (type, label names)
    "mig_agent_reconfigurations": ("counter", ("result", "layout")),
    "mig_agent_reconfiguration_phase_seconds": ("histogram", ("phase",)),
    "mig_agent_evictions": ("counter", ()),
    "mig_agent_device_taint_fallbacks": ("counter", ()),
    "mig_agent_nvml_calls": ("counter", ("call",)),
    "mig_agent_nvml_errors": ("counter", ("call",)),
    "mig_agent_api_requests": ("counter", ("call",)),
    "mig_agent_state": ("gauge", ("state",)),
    "mig_agent_mig_devices": ("gauge", ("gpu", "profile")),
    "mig_agent_unhealthy_devices": ("gauge", ("resource",)),
    "mig_agent_last_success_timestamp_seconds": ("gauge", ()),
}


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def exercised() -> Metrics:
    m = Metrics()
    m.reconfigurations.labels(result="success", layout="all-1g.10gb").inc()
    m.reconfigurations.labels(result="failed", layout="all-7g.80gb").inc()
    for phase in ("plan", "drain", "apply", "device_plugin", "verify"):
        m.phase_seconds.labels(phase=phase).observe(0.2)
    m.evictions.inc(3)
    m.nvml_calls.labels(call="observe").inc()
    m.nvml_errors.labels(call="observe").inc()
    m.api_requests.labels(call="read_node").inc()
    m.set_state("success")
    m.set_devices({0: {"1g.10gb": 7}, 1: {"3g.40gb": 2}})
    m.set_unhealthy({"nvidia.com/mig-1g.10gb": 1})
    m.last_success.set(time.time())
    return m


def test_families_names_types_and_labels() -> None:
    m = exercised()
    families = {f.name: f for f in m.registry.collect()}
    assert set(families) == set(EXPECTED)
    for name, (kind, labels) in EXPECTED.items():
        f = families[name]
        assert f.type == kind, name
        assert f.documentation, name
        for sample in f.samples:
            own = tuple(k for k in sample.labels if k != "le")
            assert sorted(own) == sorted(labels), (name, sample)
    # units: durations and timestamps in seconds, nothing else claims a unit
    assert [n for n in EXPECTED if "seconds" in n] == [
        "mig_agent_reconfiguration_phase_seconds",
        "mig_agent_last_success_timestamp_seconds",
    ]


def test_exposition_follows_prometheus_conventions() -> None:
    m = exercised()
    text = generate_latest(m.registry).decode()
    assert "_created" not in text
    names = {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert names == {
        "mig_agent_reconfigurations_total",
        "mig_agent_reconfiguration_phase_seconds_bucket",
        "mig_agent_reconfiguration_phase_seconds_sum",
        "mig_agent_reconfiguration_phase_seconds_count",
        "mig_agent_evictions_total",
        "mig_agent_device_taint_fallbacks_total",
        "mig_agent_nvml_calls_total",
        "mig_agent_nvml_errors_total",
        "mig_agent_api_requests_total",
        "mig_agent_state",
        "mig_agent_mig_devices",
        "mig_agent_unhealthy_devices",
        "mig_agent_last_success_timestamp_seconds",
    }
    assert "# TYPE mig_agent_reconfigurations_total counter" in text
    assert 'mig_agent_reconfigurations_total{layout="all-1g.10gb",result="success"} 1.0' in text
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert parsed["mig_agent_reconfigurations"].type == "counter"
    assert parsed["mig_agent_reconfiguration_phase_seconds"].type == "histogram"
    assert value(m, "mig_agent_reconfiguration_phase_seconds_count", phase="apply") == 1
    assert value(m, "mig_agent_reconfiguration_phase_seconds_bucket", phase="apply", le="0.25") == 1
    assert value(m, "mig_agent_evictions_total") == 3
    assert value(m, "mig_agent_mig_devices", gpu="0", profile="1g.10gb") == 7


def test_state_gauge_has_exactly_one_current_state() -> None:
    m = Metrics()
    for state in STATES:
        m.set_state(state)
        assert {s: value(m, "mig_agent_state", state=s) for s in STATES} == {
            s: (1.0 if s == state else 0.0) for s in STATES
        }


def test_layout_label_values_are_capped() -> None:
    m = Metrics()
    for i in range(MAX_LAYOUTS + 5):
        m.reconfigurations.labels(result="failed", layout=f"typo-{i}").inc()
    m.reconfigurations.labels(result="success", layout="typo-0").inc()  # a known one stays
    layouts = {
        s.labels["layout"]
        for f in m.registry.collect()
        if f.name == "mig_agent_reconfigurations"
        for s in f.samples
    }
    assert len(layouts) == MAX_LAYOUTS + 1
    assert OTHER_LAYOUT in layouts
    assert value(m, "mig_agent_reconfigurations_total", result="failed", layout=OTHER_LAYOUT) == 5
    assert value(m, "mig_agent_reconfigurations_total", result="success", layout="typo-0") == 1


def test_device_gauge_forgets_what_is_gone() -> None:
    m = Metrics()
    m.set_devices({0: {"1g.10gb": 7}, 1: {"1g.10gb": 7}})
    m.set_devices({0: {"7g.80gb": 1}})
    samples = [
        (s.labels["gpu"], s.labels["profile"], s.value)
        for f in m.registry.collect()
        if f.name == "mig_agent_mig_devices"
        for s in f.samples
    ]
    assert samples == [("0", "7g.80gb", 1.0)]


def test_phase_timer_records_failed_phases_too() -> None:
    m = Metrics()
    with pytest.raises(RuntimeError), m.phase("drain"):
        time.sleep(0.02)
        raise RuntimeError("PDB forbids eviction")
    assert value(m, "mig_agent_reconfiguration_phase_seconds_count", phase="drain") == 1
    assert (value(m, "mig_agent_reconfiguration_phase_seconds_sum", phase="drain") or 0) >= 0.02


def test_instrumented_gpus_count_calls_and_errors_by_call() -> None:
    m = Metrics()
    fake = FakeGpus([MODELS["H100-80GB"]] * 2)
    gpus = InstrumentedGpus(fake, m)
    assert gpus.observe() == fake.observe()
    assert gpus.models() is fake.models()
    gpus.set_mig_mode(0, enabled=True)
    gi = gpus.create_gpu_instance(0, 19, Placement(0, 1))  # 1g.10gb
    ci = gpus.create_compute_instance(0, gi, 0, Placement(0, 1))
    fake.fail_on = "create_gpu_instance"
    with pytest.raises(GpuError, match="injected failure"):
        gpus.create_gpu_instance(0, 19, Placement(1, 1))
    gpus.destroy_compute_instance(0, gi, ci)
    gpus.destroy_gpu_instance(0, gi)
    fake.fail_on = "reset_gpu"
    with pytest.raises(GpuError):
        gpus.reset_gpu(1)
    gpus.close()

    calls = {
        s.labels["call"]: s.value
        for f in m.registry.collect()
        if f.name == "mig_agent_nvml_calls"
        for s in f.samples
    }
    errors = {
        s.labels["call"]: s.value
        for f in m.registry.collect()
        if f.name == "mig_agent_nvml_errors"
        for s in f.samples
    }
    assert calls == {
        "observe": 1,
        "models": 1,
        "set_mig_mode": 1,
        "create_gpu_instance": 2,
        "create_compute_instance": 1,
        "destroy_compute_instance": 1,
        "destroy_gpu_instance": 1,
        "reset_gpu": 1,
    }
    assert errors == {"create_gpu_instance": 1, "reset_gpu": 1}


@dataclass
class Checks:
    healthz: str = ""
    readyz: str = ""
    raise_in_readyz: bool = False

    def health(self) -> str:
        return self.healthz

    def ready(self) -> str:
        if self.raise_in_readyz:
            raise OSError("state file vanished")
        return self.readyz


@pytest.fixture
def served() -> Iterator[tuple[str, Metrics, Checks]]:
    m, checks = exercised(), Checks()
    server = HealthServer(
        "127.0.0.1", 0, m.registry, healthz=checks.health, readyz=checks.ready
    ).start()
    try:
        yield f"http://127.0.0.1:{server.port}", m, checks
    finally:
        server.stop()


def get(url: str, accept: str = "") -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:  # noqa: S310 (our own server)
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_health_server_endpoints(served: tuple[str, Metrics, Checks]) -> None:
    base, m, checks = served
    status, ctype, body = get(base + "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    assert body == generate_latest(m.registry).decode()
    # what Prometheus sends: OpenMetrics preferred; still no _created series
    status, ctype, body = get(
        base + "/metrics",
        accept="application/openmetrics-text;"
        "version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.1",
    )
    assert status == 200 and ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith("# EOF\n") and "_created" not in body
    assert 'mig_agent_reconfigurations_total{layout="all-1g.10gb",result="success"} 1.0' in body
    assert get(base + "/healthz") == (200, "text/plain; charset=utf-8", "ok\n")
    assert get(base + "/readyz?verbose") == (200, "text/plain; charset=utf-8", "ok\n")

    checks.healthz = "node watch stalled"
    checks.readyz = "NVML unreachable: count GPUs: Driver Not Loaded"
    assert get(base + "/healthz")[::2] == (503, "node watch stalled\n")
    assert get(base + "/readyz")[::2] == (503, "NVML unreachable: count GPUs: Driver Not Loaded\n")
    checks.raise_in_readyz = True
    assert get(base + "/readyz")[::2] == (503, "check failed: OSError: state file vanished\n")
    assert get(base + "/nope")[0] == 404
