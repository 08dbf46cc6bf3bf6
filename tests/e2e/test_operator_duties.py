"""We test, end to end on the local cluster (agents under the DaemonSet's ServiceAccount, the
admission policies of daemonset.yaml active), MIG Manager's other duties:

* the GPU Operator's validators: kwok pods with the validators' labels on the agent's node go with
  a change (the CUDA and device plugin validators, then the operator validator), others stay;
  the agent's own credentials may delete validator pods only on its node, and no other pod of
  the operator's namespace there;
* hooks: mig-parted's hooks file and the pre- and post-apply commands run with the node's
  context; a failing post-apply command (regenerating a CDI spec, say) is ``failed`` with its
  output in the reason and the node clean, and an agent restarted with the command fixed
  finishes the change;
* host GPU clients on an A100 (a mode change needs a GPU reset): a host service's process on the
  GPU blocks the reset, and the reason names the service; with stopping on, the agent stops it
  through the host service command (here a systemctl that plays the simulated host), applies
  the layout with a reset, and starts it again.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from migsim.cluster import agents
from migsim.nvml import state as simstate

from .conftest import CONFIG, REASON, STATE, AgentNode, NodeFactory
from .test_agent import applied, assert_clean, wait_clean

NS = agents.PLUGIN_NS  # the GPU Operator's namespace, where its validators run


def validator_pod(core: client.CoreV1Api, name: str, node: str, app: str) -> Any:
    """A pod as the GPU Operator's validators are, bound to ``node`` (kwok runs it)."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "validator", "image": "nvcr.io/nvidia/validator"}],
        },
    }
    return core.create_namespaced_pod(NS, body)


def exists(core: client.CoreV1Api, pod: Any) -> bool:
    try:
        found = core.read_namespaced_pod(pod.metadata.name, NS)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return bool(found.metadata.uid == pod.metadata.uid and not found.metadata.deletion_timestamp)


@pytest.fixture
def pods(core: client.CoreV1Api) -> Iterator[list[Any]]:
    """Pods the test makes in the operator's namespace; deleted after it."""
    made: list[Any] = []
    yield made
    for pod in made:
        try:
            core.delete_namespaced_pod(pod.metadata.name, NS, grace_period_seconds=0)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


def as_agent(node: AgentNode) -> client.CoreV1Api:
    """The API as the node's agent: the DaemonSet's ServiceAccount, token bound to its pod."""
    return client.CoreV1Api(config.new_client_from_config(config_file=node.procs.kubeconfig))


def test_validators_go_with_a_change_on_the_own_node_only(
    agent_node: NodeFactory, core: client.CoreV1Api, pods: list[Any]
) -> None:
    node = agent_node("2xH100-80GB")
    tag = node.name
    cuda = validator_pod(core, f"cuda-{tag}", node.name, "nvidia-cuda-validator")
    plugin = validator_pod(core, f"plugin-{tag}", node.name, "nvidia-device-plugin-validator")
    operator = validator_pod(core, f"operator-{tag}", node.name, "nvidia-operator-validator")
    dcgm = validator_pod(core, f"dcgm-{tag}", node.name, "nvidia-dcgm")
    elsewhere = validator_pod(core, f"cuda-elsewhere-{tag}", "gpu-node-0", "nvidia-cuda-validator")
    pods.extend([cuda, plugin, operator, dcgm, elsewhere])

    # the policy: the agent's own credentials may not delete other pods, nor on other nodes
    agent = as_agent(node)
    for pod, fragment in (
        (dcgm, "may delete only the device plugin's pod"),
        (elsewhere, f"only on the node it runs on ({node.name})"),
    ):
        with pytest.raises(client.ApiException) as err:
            agent.delete_namespaced_pod(pod.metadata.name, NS)
        assert err.value.status == 403 and fragment in err.value.body, err.value.body

    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed", timeout=90) == "success", node.log_tail()
    deadline = time.monotonic() + 15
    while any(exists(core, p) for p in (cuda, plugin, operator)):
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.2)
    assert exists(core, dcgm) and exists(core, elsewhere)
    log = node.log_tail(400)
    assert "validators.deleted" in log and "validators.delete_failed" not in log
    assert_clean(node)


def event_reasons(node: AgentNode) -> set[str]:
    """The reasons of the Events about the node (the agent's pass through the events policy)."""
    events = node.core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={node.name}"
    ).items
    return {e.reason for e in events}


def relabel(node: AgentNode, layout: str) -> None:
    """As `repartition` does: the new layout, the old state cleared (no stale success)."""
    node.core.patch_node(node.name, {"metadata": {"labels": {CONFIG: layout, STATE: None}}})


def write_script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_hooks_run_with_the_nodes_context_and_a_failing_one_is_failed_with_its_output(
    agent_node: NodeFactory, tmp_path: Path
) -> None:
    log = tmp_path / "hooks.log"
    spec = tmp_path / "management.nvidia.com-gpu.yaml"
    hooks_file = tmp_path / "hooks.yaml"
    hooks_file.write_text(f"""version: v1
hooks:
  apply-start:
  - command: /bin/sh
    args: ["-c", "echo apply-start $MIG_PARTED_SELECTED_CONFIG $SITE >> {log}"]
    envs: {{SITE: rack-7}}
  apply-exit:
  - command: /bin/sh
    args: ["-c", "echo apply-exit $MIG_AGENT_RESULT >> {log}"]
""")
    # stands in for `nvidia-ctk cdi generate --mode=management ...`
    cdi = write_script(
        tmp_path / "cdi-generate",
        f"""\
echo "post-apply $NODE_NAME $MIG_AGENT_LAYOUT gpus=$MIG_AGENT_CHANGED_GPUS" >> {log}
echo "devices: $MIG_AGENT_CHANGED_GPU_UUIDS" > {spec}
""",
    )
    pre = write_script(tmp_path / "pre-apply", f"echo pre-apply $MIG_AGENT_MODE_CHANGE >> {log}\n")
    settings = {
        "MIG_AGENT_HOOKS_FILE": str(hooks_file),
        "MIG_AGENT_PRE_APPLY_COMMAND": pre,
        "MIG_AGENT_POST_APPLY_COMMAND": cdi,
    }
    node = agent_node("2xH100-80GB", settings=settings)
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed", timeout=90) == "success", node.log_tail()
    assert log.read_text().splitlines() == [
        "apply-start all-1g.10gb rack-7",
        "pre-apply true",
        "apply-exit success",
        f"post-apply {node.name} all-1g.10gb gpus=0,1",
    ]
    assert spec.read_text().startswith("devices: GPU-")
    assert "MIGPostApply" in event_reasons(node)
    assert_clean(node)

    broken = write_script(
        tmp_path / "cdi-broken",
        """\
echo "generating the management CDI spec"
echo "nvidia-ctk: failed to locate libnvidia-ml.so.1" >&2
exit 4
""",
    )
    node.restart_agent({**settings, "MIG_AGENT_POST_APPLY_COMMAND": broken})
    relabel(node, "all-balanced")
    assert node.wait_state("failed", "success", timeout=90) == "failed", node.log_tail()
    reason = node.node().metadata.annotations[REASON]
    assert reason == (
        f"post-apply hook `{broken}` exited with status 4: generating the "
        "management CDI spec | nvidia-ctk: failed to locate libnvidia-ml.so.1; the GPUs had "
        "changed: the device plugin was restarted and advertises them as they are now"
    )
    assert applied(node, "all-balanced")  # the GPUs are done; the hook is what is left
    wait_clean(node)
    # fixed: the restarted agent runs what was left, and only that
    before = simstate.call_counts(node.sim_state).total
    node.restart_agent(settings)
    assert node.wait_state("success", timeout=90) == "success", node.log_tail()
    assert log.read_text().splitlines()[-1] == f"post-apply {node.name} all-balanced gpus="
    assert simstate.call_counts(node.sim_state).total == before
    annotations = node.node().metadata.annotations
    assert REASON not in annotations and "mig-agent.dev/post-apply-pending" not in annotations
    assert_clean(node)


SYSTEMCTL = """\
import sys
from migsim.nvml import state

# systemctl of a simulated host: a service runs while a process it owns is on GPU 0
path, action, name = sys.argv[1:4]
running = name in state.processes_by_owner(path)
with open(path + ".systemctl.log", "a") as log:
    log.write(f"{action} {name}\\n")
if action == "is-active":
    print("active" if running else "inactive")
    sys.exit(0 if running else 3)
if action == "stop":
    state.end_processes(path, [name])
elif action == "start" and not running:
    state.start_process(path, 0, owner=name)
"""


def test_host_gpu_clients_block_an_a100_reset_or_are_stopped_and_started_again(
    agent_node: NodeFactory, tmp_path: Path
) -> None:
    clients = tmp_path / "clients.yaml"
    clients.write_text("version: v1\nsystemd-services: [nvsm.service, nvidia-dcgm.service]\n")
    script = tmp_path / "systemctl.py"
    script.write_text(SYSTEMCTL)
    off = {
        "MIG_AGENT_HOST_GPU_CLIENTS_FILE": str(clients),
        "MIG_AGENT_GPU_RELEASE_TIMEOUT_S": "1",
        "MIG_AGENT_BACKOFF_S": "30",
    }
    node = agent_node("1xA100-40GB", settings=off)
    command = f"{sys.executable} {script} {node.sim_state}"
    pid = simstate.start_process(node.sim_state, 0, owner="nvidia-dcgm.service")
    node.restart_agent({**off, "MIG_AGENT_HOST_SERVICE_COMMAND": command})
    node.label("all-1g.5gb")
    assert node.wait_state("failed", "success", timeout=60) == "failed", node.log_tail()
    reason = node.node().metadata.annotations[REASON]
    assert f"MIG mode change is in use by process(es) {pid}" in reason, reason
    assert (
        "GPU(s) [0] need a reset for the MIG mode change; host GPU client service(s) "
        "running: nvidia-dcgm.service"
    ) in reason, reason
    assert not simstate.load_node(node.sim_state).gpus[0].mig_current
    wait_clean(node)

    calls = Path(node.sim_state + ".systemctl.log")
    calls.unlink()
    node.restart_agent(
        {
            **off,
            "MIG_AGENT_HOST_SERVICE_COMMAND": command,
            "MIG_AGENT_STOP_HOST_GPU_CLIENTS": "true",
        }
    )
    assert node.wait_state("success", timeout=90) == "success", node.log_tail()
    assert calls.read_text().splitlines() == [
        "is-active nvsm.service",
        "is-active nvidia-dcgm.service",
        "stop nvidia-dcgm.service",
        "start nvidia-dcgm.service",
    ]
    gpu = simstate.load_node(node.sim_state).gpus[0]
    assert gpu.mig_current and len(gpu.gpu_instances) == 7
    assert "nvidia-dcgm.service" in simstate.processes_by_owner(node.sim_state)  # runs again
    assert simstate.call_counts(node.sim_state).by_function.get("reset", 0) >= 1
    annotations = node.node().metadata.annotations
    assert "mig-agent.dev/stopped-host-services" not in annotations
    assert {"MIGHostClientsStopped", "MIGHostClientsStarted"} <= event_reasons(node)
    assert json.loads(annotations["mig-agent.dev/gpu-state"])["gpus"][0]["gpu_instances"]
    assert_clean(node)
