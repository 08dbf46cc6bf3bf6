"""We test MIG Manager's other duties in the agent's pass, with the in-memory fakes of
tests/unit/test_agent.py (hooks run as real processes where their output matters):

* the GPU Operator's validators: the CUDA and device plugin validator pods on the node go while
  draining (before any GPU changes), the operator validator after a change, nothing of other
  nodes, namespaces or apps, nothing on a no-op pass or with the setting off;
* hooks: mig-parted's hooks run in its order around the mode and config phases, with the node's
  context; a failing or hanging pre-apply command fails the pass with GPUs untouched, a failing
  post-apply command fails it with its output in the reason and the node clean, and the next
  pass after the fix runs only the hook; apply-exit runs after a failed apply too;
* host GPU clients for a mode change that needs a reset (A100): off, the reason names the
  running services and the processes; on, the active ones are stopped for the apply and
  started again; a service that does not stop fails the pass with the others started again; a
  killed agent's stopped services are started by the next one; no reset (H100): not touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import pytest

from mig_agent.agent import Agent, Outcome
from mig_agent.core.gpu_models import MODELS
from mig_agent.host import commands
from mig_agent.host.commands import Command, Completed
from tests.unit.fake_cluster import FakeCluster

from .fake_gpus import FakeGpus
from .test_agent import DP_LABEL, DP_NS, NODE, STATE, Crash, assert_clean, label, make

REASON = "mig-agent.dev/reason"
POST_APPLY_PENDING = "mig-agent.dev/post-apply-pending"
STOPPED = "mig-agent.dev/stopped-host-services"


# ---- the GPU Operator's validators ----------------------------------------------------------


def add_validators(cluster: FakeCluster) -> dict[str, object]:
    return {
        "cuda": cluster.add_pod(DP_NS, "cuda", NODE, labels={"app": "nvidia-cuda-validator"}),
        "plugin": cluster.add_pod(
            DP_NS, "plugin-val", NODE, labels={"app": "nvidia-device-plugin-validator"}
        ),
        "operator": cluster.add_pod(
            DP_NS,
            "operator-val",
            NODE,
            owner="DaemonSet",
            labels={"app": "nvidia-operator-validator"},
        ),
        "other_node": cluster.add_pod(
            DP_NS, "cuda-other", "gpu-node-1", labels={"app": "nvidia-cuda-validator"}
        ),
        "other_ns": cluster.add_pod(
            "work", "cuda-lookalike", NODE, labels={"app": "nvidia-cuda-validator"}
        ),
        "other_app": cluster.add_pod(DP_NS, "dcgm", NODE, labels={"app": "nvidia-dcgm"}),
    }


def test_validators_go_before_and_after_a_change_and_nothing_else_does() -> None:
    agent, cluster, gpus = make()
    pods = add_validators(cluster)
    at_first_gpu_call: set[str] = set()
    create = gpus.create_gpu_instance

    def spy(*args: object, **kw: object) -> int:
        if not at_first_gpu_call:
            at_first_gpu_call.update(p.name for p in cluster.pods)
        return create(*args, **kw)  # type: ignore[arg-type]

    gpus.create_gpu_instance = spy  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    # gone before the GPUs changed: the CUDA and plugin validators; the operator's still there
    assert "cuda" not in at_first_gpu_call and "plugin-val" not in at_first_gpu_call
    assert "operator-val" in at_first_gpu_call
    left = set(cluster.pods)
    assert not {pods["cuda"], pods["plugin"], pods["operator"]} & left
    assert {pods["other_node"], pods["other_ns"], pods["other_app"]} <= left
    assert not cluster.evicted  # deleted, not drained: they hold no GPU
    # a pass with nothing to change deletes no validator
    again = cluster.add_pod(
        DP_NS, "operator-val-2", NODE, labels={"app": "nvidia-operator-validator"}
    )
    assert agent.reconcile_once().outcome is Outcome.NOOP
    assert again in cluster.pods


def test_validators_stay_with_the_setting_off() -> None:
    agent, cluster, _ = make(restart_validators=False)
    pods = add_validators(cluster)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert set(pods.values()) <= set(cluster.pods)


def test_a_failed_delete_of_the_operator_validator_does_not_fail_an_applied_layout() -> None:
    agent, cluster, _ = make()
    add_validators(cluster)
    delete = cluster.delete_pod

    def refuse(ref: object) -> None:
        from mig_agent.core.errors import KubeError

        if getattr(ref, "name", "") == "operator-val":
            raise KubeError("forbidden (fake)")
        delete(ref)  # type: ignore[arg-type]

    cluster.delete_pod = refuse  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success"


# ---- hooks ----------------------------------------------------------------------------------


def recording_runner(
    gpus: FakeGpus, seen: list[tuple[str, Mapping[str, str], tuple[bool, int]]]
) -> commands.Runner:
    """Runs each command for real, noting its hook, environment and GPU 0 at that moment."""

    def run(command: Command, env: Mapping[str, str], timeout_s: float) -> Completed:
        g = gpus.observe().gpu(0)
        seen.append(
            (env.get("MIG_AGENT_HOOK", ""), dict(env), (g.mig_current, len(g.gpu_instances)))
        )
        return commands.run_command(command, env, timeout_s)

    return run


def hooks_file(tmp_path: Path, names: tuple[str, ...]) -> str:
    body = "".join(f"  {n}:\n  - command: /bin/true\n    envs: {{SITE: {n}}}\n" for n in names)
    path = tmp_path / "hooks.yaml"
    path.write_text("version: v1\nhooks:\n" + body)
    return str(path)


def test_hooks_run_in_mig_parteds_order_with_the_nodes_context(tmp_path: Path) -> None:
    names = ("apply-start", "pre-apply-mode", "pre-apply-config", "apply-exit", "post-apply")
    agent, cluster, gpus = make(
        hooks_file=hooks_file(tmp_path, names),
        pre_apply_command="/bin/true pre",
        post_apply_command="/bin/true post",
    )
    seen: list[tuple[str, Mapping[str, str], tuple[bool, int]]] = []
    agent.run_command = recording_runner(gpus, seen)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert [h for h, _, _ in seen] == [
        "apply-start",
        "apply-start",
        "pre-apply-mode",
        "pre-apply-config",
        "apply-exit",
        "post-apply",
        "post-apply",
    ]
    gpu0 = {h: g for h, _, g in seen}
    # mode phase between pre-apply-mode and pre-apply-config, instances after
    assert gpu0["pre-apply-mode"] == (False, 0) and gpu0["pre-apply-config"] == (True, 0)
    assert gpu0["apply-exit"] == (True, 7)
    env = seen[0][1]
    assert env["SITE"] == "apply-start" and env["NODE_NAME"] == NODE
    assert env["MIG_PARTED_SELECTED_CONFIG"] == env["MIG_AGENT_LAYOUT"] == "all-1g.10gb"
    assert env["MIG_AGENT_CHANGED_GPUS"] == "0,1,2,3,4,5,6,7"
    assert env["MIG_AGENT_CHANGED_GPU_UUIDS"].split(",")[0] == "GPU-00000000"
    assert env["MIG_AGENT_MODE_CHANGE"] == "true" and env["MIG_PARTED_CONFIG_FILE"]
    exit_env = next(e for h, e, _ in seen if h == "apply-exit")
    assert (exit_env["MIG_AGENT_RESULT"], exit_env["MIG_AGENT_ERROR"]) == ("success", "")
    assert "MIGPostApply" in [e[1] for e in cluster.events]
    assert POST_APPLY_PENDING not in cluster.nodes[NODE].annotations
    # only instances change now: no mode phase, no pre-apply-mode
    seen.clear()
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert "pre-apply-mode" not in [h for h, _, _ in seen]
    assert seen[0][1]["MIG_AGENT_MODE_CHANGE"] == "false"


def test_a_failing_post_apply_command_fails_with_its_output_and_the_fix_finishes() -> None:
    agent, cluster, gpus = make(
        post_apply_command="sh -c 'echo generating; echo nvidia-ctk: no such file >&2; exit 3'"
    )
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert result.outcome is Outcome.FAILED and result.retry_after_s is None
    assert node.labels[STATE] == "failed"
    assert node.annotations[REASON] == (
        "post-apply hook `sh -c 'echo generating; echo nvidia-ctk: no such file >&2; exit 3'` "
        "exited with status 3: generating | nvidia-ctk: no such file; the GPUs had changed: "
        "the device plugin was restarted and advertises them as they are now"
    )
    assert node.annotations[POST_APPLY_PENDING] == "all-1g.10gb"
    assert_clean(cluster)
    assert node.labels[DP_LABEL] == "true"
    # the layout is on the GPUs; fixed, the next pass runs only what was left: the hook
    calls = sum(gpus.calls.values())
    agent.settings = agent.settings.replace(post_apply_command="/bin/true")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "success" and POST_APPLY_PENDING not in node.annotations
    assert sum(gpus.calls.values()) == calls
    assert_clean(cluster)


@pytest.mark.parametrize(
    "command, fragment",
    [
        (
            "sh -c 'echo site check failed; exit 1'",
            "apply-start hook `sh -c 'echo site check failed; exit 1'` exited with status 1: "
            "site check failed",
        ),
        ("sleep 30", "apply-start hook `sleep 30` did not finish within 0.3 s (killed)"),
        ("/nonexistent/site-hook", "apply-start hook `/nonexistent/site-hook` could not run"),
    ],
)
def test_a_failing_pre_apply_command_leaves_the_gpus_untouched(command: str, fragment: str) -> None:
    agent, cluster, gpus = make(pre_apply_command=command, command_timeout_s=0.3)
    pod = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert result.outcome is Outcome.FAILED and node.labels[STATE] == "failed"
    assert fragment in node.annotations[REASON]
    assert not gpus.calls and cluster.evicted == [pod]
    assert_clean(cluster)


def test_apply_exit_runs_after_a_failed_apply_whose_error_stays_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "hooks.yaml"
    path.write_text("version: v1\nhooks:\n  apply-exit:\n  - command: /bin/false\n")
    agent, cluster, gpus = make(hooks_file=str(path))
    seen: list[tuple[str, Mapping[str, str], tuple[bool, int]]] = []
    agent.run_command = recording_runner(gpus, seen)
    gpus.fail_on = "create_gpu_instance"
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    ((hook, env, _),) = seen
    assert hook == "apply-exit" and env["MIG_AGENT_RESULT"] == "failed"
    assert "injected failure in create_gpu_instance" in env["MIG_AGENT_ERROR"]
    assert "injected failure" in cluster.nodes[NODE].annotations[REASON]  # not the hook's
    assert_clean(cluster)


def test_a_malformed_hooks_file_fails_before_anything_is_touched(tmp_path: Path) -> None:
    path = tmp_path / "hooks.yaml"
    path.write_text("version: v1\nhooks:\n  post-aply: []\n")
    agent, cluster, gpus = make(hooks_file=str(path))
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    node = cluster.nodes[NODE]
    assert "hook 'post-aply': no such hook" in node.annotations[REASON]
    assert "did you mean post-apply?" in node.annotations[REASON]
    assert not gpus.calls and not node.unschedulable and node.labels[DP_LABEL] == "true"


# ---- host GPU clients -----------------------------------------------------------------------


class Host:
    """systemctl of a host whose services hold GPU 0 (a process each) while they run."""

    def __init__(self, gpus: FakeGpus, running: dict[str, int], refuse: str = "") -> None:
        self.gpus, self.running, self.refuse = gpus, dict(running), refuse
        self.stopped: dict[str, int] = {}
        self.calls: list[str] = []
        for pid in running.values():
            gpus.add_process(0, pid, None)

    def __call__(self, command: Command, env: Mapping[str, str], timeout_s: float) -> Completed:
        *base, action, name = command.argv
        assert base == ["chroot", "/host", "systemctl"]
        self.calls.append(f"{action} {name}")
        if action == "is-active":
            return Completed(0, "active") if name in self.running else Completed(3, "inactive")
        if action == "stop":
            if name == self.refuse:
                return Completed(1, f"Failed to stop {name}: Access denied")
            pid = self.running.pop(name)
            self.stopped[name] = pid
            g = self.gpus.gpus[0]
            self.gpus.gpus[0] = type(g)(
                **{
                    **{f: getattr(g, f) for f in g.__slots__},
                    "processes": tuple(p for p in g.processes if p.pid != pid),
                }
            )
            return Completed(0, "")
        if action == "start":
            if name in self.stopped:
                self.running[name] = self.stopped.pop(name)
                self.gpus.add_process(0, self.running[name], None)
            return Completed(0, "")
        raise AssertionError(action)


def a100_node(tmp_path: Path, **settings: object) -> tuple[Agent, FakeCluster, FakeGpus]:
    clients = tmp_path / "clients.yaml"
    clients.write_text(
        "version: v1\nsystemd-services: [nvsm.service, nvidia-dcgm.service, "
        "dcgm-exporter.service]\n"
    )
    return make(
        FakeGpus([MODELS["A100-40GB"]] * 2),
        host_gpu_clients_file=str(clients),
        gpu_release_timeout_s=3.0,
        **settings,
    )


def test_off_the_reason_names_the_running_host_services_and_processes(tmp_path: Path) -> None:
    agent, cluster, gpus = a100_node(tmp_path)
    host = Host(gpus, {"nvidia-dcgm.service": 4242})
    agent.run_command = host
    label(cluster, "all-1g.5gb")
    result = agent.reconcile_once()
    reason = cluster.nodes[NODE].annotations[REASON]
    assert result.outcome is Outcome.FAILED and result.retry_after_s is not None
    assert "MIG mode change is in use by process(es) 4242" in reason
    assert (
        "GPU(s) [0, 1] need a reset for the MIG mode change; host GPU client service(s) "
        "running: nvidia-dcgm.service (stopping them is off"
    ) in reason
    assert not any(c.startswith(("stop", "start")) for c in host.calls)
    assert not gpus.calls
    assert_clean(cluster)


def test_off_without_a_clients_file_the_reason_says_how_to_name_them() -> None:
    agent, cluster, gpus = make(FakeGpus([MODELS["A100-40GB"]]), gpu_release_timeout_s=1.0)
    gpus.add_process(0, 777, None)
    label(cluster, "all-1g.5gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "process(es) 777" in reason and "MIG_AGENT_HOST_GPU_CLIENTS_FILE" in reason


def test_on_the_active_host_services_stop_for_the_reset_and_start_again(tmp_path: Path) -> None:
    agent, cluster, gpus = a100_node(tmp_path, stop_host_gpu_clients=True)
    host = Host(gpus, {"nvsm.service": 100, "nvidia-dcgm.service": 101})
    agent.run_command = host
    held_at_mode_change: list[int] = []
    set_mode = gpus.set_mig_mode

    def spy(gpu: int, *, enabled: bool) -> None:
        held_at_mode_change.extend(p.pid for p in gpus.gpus[gpu].processes)
        set_mode(gpu, enabled=enabled)

    gpus.set_mig_mode = spy  # type: ignore[method-assign]
    label(cluster, "all-1g.5gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert host.calls == [
        "is-active nvsm.service",
        "is-active nvidia-dcgm.service",
        "is-active dcgm-exporter.service",
        "stop nvsm.service",
        "stop nvidia-dcgm.service",
        "start nvsm.service",
        "start nvidia-dcgm.service",
    ]
    assert held_at_mode_change == []
    assert sorted(p.pid for p in gpus.gpus[0].processes) == [100, 101]  # running again
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "success" and STOPPED not in node.annotations
    assert [(e[1], e[2]) for e in cluster.events if "HostClients" in e[1]] == [
        (
            "MIGHostClientsStopped",
            "stopped host GPU client(s) nvsm.service, "
            "nvidia-dcgm.service for the reset of GPU(s) [0, 1]",
        ),
        (
            "MIGHostClientsStarted",
            "started host GPU client(s) nvsm.service, nvidia-dcgm.service again",
        ),
    ]
    assert_clean(cluster)


def test_a_service_that_does_not_stop_fails_the_pass_and_the_others_start_again(
    tmp_path: Path,
) -> None:
    agent, cluster, gpus = a100_node(tmp_path, stop_host_gpu_clients=True)
    host = Host(
        gpus, {"nvsm.service": 100, "nvidia-dcgm.service": 101}, refuse="nvidia-dcgm.service"
    )
    agent.run_command = host
    label(cluster, "all-1g.5gb")
    result = agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert result.outcome is Outcome.FAILED and result.retry_after_s is not None
    assert node.annotations[REASON] == (
        "could not stop host GPU client nvidia-dcgm.service for the reset of GPU(s) [0, 1]: "
        "exited with status 1: Failed to stop nvidia-dcgm.service: Access denied"
    )
    assert "start nvsm.service" in host.calls and host.running.keys() == {
        "nvsm.service",
        "nvidia-dcgm.service",
    }
    assert not gpus.calls and STOPPED not in node.annotations
    assert_clean(cluster)


def test_services_a_killed_agent_stopped_are_started_by_the_next(tmp_path: Path) -> None:
    agent, cluster, gpus = a100_node(tmp_path, stop_host_gpu_clients=True)
    host = Host(gpus, {"nvsm.service": 100})
    agent.run_command = host

    def killed(*args: object, **kw: object) -> int:
        raise Crash()

    create = gpus.create_gpu_instance
    gpus.create_gpu_instance = killed  # type: ignore[method-assign]
    label(cluster, "all-1g.5gb")
    with contextlib.suppress(Crash):
        agent.reconcile_once()
    assert cluster.nodes[NODE].annotations[STOPPED] == "nvsm.service"
    gpus.create_gpu_instance = create  # type: ignore[method-assign]
    host.calls.clear()
    fresh, _, _ = a100_node(tmp_path, stop_host_gpu_clients=True)
    fresh.cluster, fresh.gpus, fresh.run_command = cluster, gpus, host
    fresh.reload_config()
    # started first thing; the mode change already done, nothing needs a reset now
    assert fresh.reconcile_once().outcome is Outcome.APPLIED
    assert host.calls == ["start nvsm.service"]
    assert STOPPED not in cluster.nodes[NODE].annotations
    assert_clean(cluster)


def test_a_mode_change_without_a_reset_stops_no_service(tmp_path: Path) -> None:
    clients = tmp_path / "clients.yaml"
    clients.write_text("version: v1\nsystemd-services: [nvsm.service]\n")
    agent, cluster, gpus = make(host_gpu_clients_file=str(clients), stop_host_gpu_clients=True)
    host = Host(gpus, {})
    agent.run_command = host
    label(cluster, "all-1g.10gb")  # H100: the mode changes without a reset
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert host.calls == []


def no_chroot(command: Command, env: Mapping[str, str], timeout_s: float) -> Completed:
    return Completed(
        125, "chroot: cannot change root directory to '/host': No such file or directory"
    )


def test_a_service_command_that_cannot_answer_is_said_so_not_taken_for_stopped(
    tmp_path: Path,
) -> None:
    agent, cluster, gpus = a100_node(tmp_path)
    gpus.add_process(0, 4242, None)
    agent.run_command = no_chroot
    label(cluster, "all-1g.5gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "process(es) 4242" in reason and "none of the host GPU clients" not in reason
    assert (
        "(nvsm.service, nvidia-dcgm.service, dcgm-exporter.service) may hold the GPU "
        "(`chroot /host systemctl is-active nvsm.service` exited with status 125: chroot: "
        "cannot change root directory to '/host'"
    ) in reason
    # with stopping on, the pass fails before any GPU or service is touched
    agent.settings = agent.settings.replace(stop_host_gpu_clients=True)
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert (
        cluster.nodes[NODE]
        .annotations[REASON]
        .startswith(
            "cannot tell which host GPU clients run: `chroot /host systemctl is-active "
            "nvsm.service` exited with status 125"
        )
    )
    assert not gpus.calls
    assert_clean(cluster)


def test_a_forged_stopped_services_list_starts_only_listed_services(tmp_path: Path) -> None:
    """The annotation is on the Node, where others may write: a unit the clients list does not
    name is never started (nor passed to the service command), and the list is cleared."""
    agent, cluster, gpus = a100_node(tmp_path, stop_host_gpu_clients=True)
    host = Host(gpus, {})
    host.stopped["nvsm.service"] = 100  # stopped by an earlier agent, on the list
    agent.run_command = host
    cluster.nodes[NODE].annotations[STOPPED] = "nvsm.service,evil.service,--now,sshd.service"
    label(cluster, "all-disabled")
    agent.reconcile_once()
    assert [c for c in host.calls if c.startswith("start")] == ["start nvsm.service"]
    assert STOPPED not in cluster.nodes[NODE].annotations
