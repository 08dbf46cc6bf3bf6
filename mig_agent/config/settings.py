"""Settings of the agent: one frozen dataclass, read from the environment, overridden by flags.

Every setting has an environment twin ``MIG_AGENT_<NAME>`` (upper case); the node name also comes
from ``NODE_NAME`` as a DaemonSet passes it through the downward API. Label keys are settings, so
the agent can run beside NVIDIA's MIG Manager under other keys.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mig_agent.core.errors import ConfigError


def _profiles() -> Path:
    # installed: inside the package; a source checkout keeps them at the top of the tree
    # (setuptools maps that folder into the package, but an editable install does not copy it)
    package = Path(__file__).resolve().parents[1]
    shipped = package / "profiles"
    return shipped if shipped.is_dir() else package.parent / "profiles"


PROFILES = _profiles()
"""The default layouts, shipped inside the package (the DaemonSet mounts its ConfigMap instead)."""


@dataclass(frozen=True, slots=True)
class Settings:
    node_name: str = ""
    """The Node this agent owns."""
    config: str = str(PROFILES)
    """Profile config file or folder (in the DaemonSet, its ConfigMap mount)."""
    config_label: str = "nvidia.com/mig.config"
    """Node label that selects the layout."""
    state_label: str = "nvidia.com/mig.config.state"
    """Node label the agent writes: pending, rebooting, success, failed."""
    annotation_prefix: str = "mig-agent.dev"
    """Prefix of the agent's own annotations and its node condition."""
    condition_type: str = "MIGConfigApplied"
    """Node condition the agent maintains (status True when the layout is applied)."""
    operand_labels: tuple[str, ...] = (
        "nvidia.com/gpu.deploy.device-plugin",
        "nvidia.com/gpu.deploy.gpu-feature-discovery",
        "nvidia.com/gpu.deploy.dcgm-exporter",
        "nvidia.com/gpu.deploy.dcgm",
        "nvidia.com/gpu.deploy.nvsm",
        "nvidia.com/gpu.deploy.client",
    )
    """GPU Operator operand labels paused (``paused-for-mig-change``) during a change."""
    device_plugin_namespace: str = "gpu-operator"
    device_plugin_selector: str = "app=nvidia-device-plugin-daemonset"
    """Namespace and label selector of the device plugin pod (restarted after a change)."""
    dra: bool = True
    """Look for NVIDIA's DRA kubelet plugin on the node: where it runs, the node's MIG devices
    are claimed through ResourceClaims (drained by claim, republished by restarting that
    plugin). On by default: on a DRA node an agent that did not look would destroy claimed
    devices under running pods."""
    device_taints: bool = True
    """On a DRA node whose API server has DeviceTaintRules (Kubernetes 1.37 on), take only the
    devices of the GPUs that change out of scheduling (a NoSchedule taint on each) instead of
    cordoning the node: the other GPUs take new claims during the change. Off: the cordon."""
    dra_plugin_namespace: str = "gpu-operator"
    dra_plugin_selector: str = "app=nvidia-dra-driver-kubelet-plugin"
    """Namespace and label selector of the DRA kubelet plugin pod, as the GPU Operator's
    GPUCluster deploys it (NVIDIA's DRA chart: dra-driver-nvidia-gpu and
    dra-driver-nvidia-gpu-component=kubelet-plugin)."""
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    """The kubelet's PodResources socket: which pod holds which GPU device, so that only pods on
    changed GPUs are drained (without it, every GPU pod of the node is)."""
    mig_strategy: str = "mixed"
    """How the device plugin advertises MIG devices: mixed or single. The node's
    ``mig_strategy_label`` overrides it."""
    mig_strategy_label: str = "nvidia.com/mig.strategy"
    """Node label GPU Feature Discovery sets to the device plugin's MIG strategy; where present
    it wins over mig_strategy (empty: always mig_strategy)."""
    device_plugin_config: str = ""
    """The device plugin's config file (NVIDIA's format; its ``sharing`` multiplies and renames
    what the node advertises), or a folder of them: the GPU Operator's plugin ConfigMap mounted
    as a volume, one file per config name. Empty: the plugin runs without a config."""
    device_plugin_config_label: str = "nvidia.com/device-plugin.config"
    device_plugin_config_default: str = ""
    """In a device_plugin_config folder, the node label naming this node's config, and the
    config used without that label (the Operator's ``devicePlugin.config.default``); with
    neither, no config, as the Operator's config-manager falls back to an empty one."""
    drain_timeout_s: float = 300.0
    """How long PodDisruptionBudgets are retried, and the least the drain waits for evicted GPU
    pods to go (each evicted pod is waited for at least its own grace period and 30 s)."""
    drain_give_up_s: float = 3600.0
    """How long a drain that fails (a budget that never allows the eviction, pods that do not
    go) is retried, counted from its first failed try, with the node kept cordoned between
    tries; then the agent uncordons and says ``failed`` until the label or config changes."""
    evict_unmanaged_pods: bool = False
    """Let the drain evict GPU pods no controller owns (gone for good once evicted). Off, as
    kubectl drain without --force: the pass is refused before the cordon, naming them."""
    delete_emptydir_data: bool = False
    """Let the drain evict GPU pods whose emptyDir volumes hold data (lost once evicted). Off,
    as kubectl drain without --delete-emptydir-data: the pass is refused before the cordon,
    naming them."""
    operand_timeout_s: float = 300.0
    """How long to wait for paused operand pods to go."""
    device_plugin_timeout_s: float = 300.0
    """How long to wait for the device plugin to advertise the new resources."""
    gpu_release_timeout_s: float = 30.0
    """After the drain, how long the processes of evicted pods may take to leave the GPUs
    before the GPU counts as busy."""
    agent_selector: str = "app.kubernetes.io/name=mig-agent"
    """Label selector of the agent's own pods (to name the RuntimeClass it runs under when it
    finds no NVML)."""
    generate_config: bool = False
    """Add layouts generated from the GPUs' own MIG profiles (all-disabled, all-enabled,
    all-<profile>) for GPU models no profile config covers, as MIG Manager does for new
    hardware."""
    stall_s: float = 600.0
    """/healthz fails when the reconcile loop (or the node watch) shows no sign of life for
    this long: a blocked call or a deadlock, never merely a long wait for a label."""
    eviction_retry_s: float = 5.0
    """Pause between eviction attempts a PodDisruptionBudget refused."""
    poll_s: float = 1.0
    """Poll interval while waiting for pods and resources."""
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0
    """Capped exponential backoff of retryable failures."""
    resync_s: float = 300.0
    """Reconcile at least this often even without events."""
    watch_timeout_s: int = 300
    """Server-side timeout of one node watch; the watch then reconnects."""
    reboot_command: str = ""
    """Command run when a MIG mode change needs a reboot (empty: never reboot)."""
    reboot_timeout_s: float = 120.0
    """How long the reboot command may run: one still running then is killed, and the pass is
    failed naming the command (the node did not reboot; the reboot guard is not armed)."""
    restart_validators: bool = True
    """The GPU Operator's validators, as MIG Manager does: while draining, delete the pods
    ``app=nvidia-cuda-validator`` and ``app=nvidia-device-plugin-validator`` on this node, and
    after a change ``app=nvidia-operator-validator``, so that the operator validates the new
    devices. In device_plugin_namespace, the GPU Operator's namespace."""
    hooks_file: str = ""
    """mig-parted's hooks file (``version: v1``, ``hooks: {name: [{command, args, envs,
    workdir}]}``): apply-start, pre-apply-mode, pre-apply-config and apply-exit as
    mig-parted runs them, and post-apply (after a successful apply). Empty: none."""
    pre_apply_command: str = ""
    """Command run after the drain, before any GPU changes (the last of apply-start)."""
    post_apply_command: str = ""
    """Command run after the layout is applied and verified, before the device plugin restarts
    (the last of post-apply); typically regenerating the management CDI spec. Its failure is
    state failed with its output in the reason."""
    command_timeout_s: float = 120.0
    """How long each hook or host service command may run."""
    host_gpu_clients_file: str = ""
    """The host's GPU clients, in the GPU Operator's ``default-gpu-clients`` format
    (``version: v1``, ``systemd-services: [...]``). Empty: none known."""
    stop_host_gpu_clients: bool = False
    """For a MIG mode change that needs a GPU reset (Ampere), stop the host GPU clients that
    are active and start them again afterwards. Off: a reset they block fails, naming them."""
    host_service_command: str = "chroot /host systemctl"
    """systemctl, or a command that takes its arguments: ``is-active SERVICE``,
    ``stop SERVICE``, ``start SERVICE`` (the host's root mounted at /host)."""
    observe: bool = False
    """Observe only (``mig-agent run --observe``): watch the layout label, plan, and say what a
    change would do (an Event and the ``observe_annotation``), changing nothing: no cordon,
    eviction, pause, plugin restart, state label, condition or hook, and the GPUs open
    read-only. Beside NVIDIA's MIG Manager, before it hands a pool over."""
    backend: str = "nvml"
    """GPU library: nvml or simulated."""
    sim_state: str = ""
    """State file of the simulated node (simulated backend)."""
    metrics_port: int = 9400
    """Port of /metrics, /healthz and /readyz (0: off)."""
    metrics_address: str = "0.0.0.0"
    kubeconfig: str = ""
    """Kubeconfig file; empty: in-cluster credentials, else KUBECONFIG or ~/.kube/config."""

    @property
    def cordon_annotation(self) -> str:
        return f"{self.annotation_prefix}/cordoned"

    @property
    def paused_annotation(self) -> str:
        return f"{self.annotation_prefix}/paused-operands"

    @property
    def reason_annotation(self) -> str:
        return f"{self.annotation_prefix}/reason"

    @property
    def gpu_state_annotation(self) -> str:
        return f"{self.annotation_prefix}/gpu-state"

    @property
    def reboot_annotation(self) -> str:
        return f"{self.annotation_prefix}/reboot-attempted"

    @property
    def post_apply_annotation(self) -> str:
        """The layout whose post-apply hooks have yet to succeed."""
        return f"{self.annotation_prefix}/post-apply-pending"

    @property
    def host_services_annotation(self) -> str:
        """The host services the agent stopped and has yet to start again."""
        return f"{self.annotation_prefix}/stopped-host-services"

    @property
    def observe_annotation(self) -> str:
        """What the agent in observe mode would do for the layout label (JSON)."""
        return f"{self.annotation_prefix}/observed-plan"

    @property
    def taint_key(self) -> str:
        """The key of the device taints the agent writes on a DRA node (what a toleration of
        a change would name)."""
        return f"{self.annotation_prefix}/mig-change"

    @property
    def guard_annotation(self) -> str:
        """What the agent owes the node it cordoned (mig_agent.core.guard.Record, JSON)."""
        return f"{self.annotation_prefix}/guard"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``MIG_AGENT_*`` variables, then ``overrides`` (None values ignored)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"MIG_AGENT_{f.name.upper()}")
            if f.name == "node_name" and raw is None:
                raw = env.get("NODE_NAME")
            if raw is not None:
                values[f.name] = _convert(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        if settings.mig_strategy not in ("mixed", "single"):
            raise ConfigError(
                f"mig strategy must be mixed or single, got {settings.mig_strategy!r}"
            )
        for name in ("pre_apply_command", "post_apply_command", "host_service_command"):
            _check_command(name, getattr(settings, name))
        if settings.command_timeout_s <= 0:
            raise ConfigError(f"command timeout must be positive, got {settings.command_timeout_s}")
        if settings.reboot_timeout_s <= 0:
            raise ConfigError(f"reboot timeout must be positive, got {settings.reboot_timeout_s}")
        if settings.stop_host_gpu_clients and not settings.host_gpu_clients_file:
            raise ConfigError(
                "stop_host_gpu_clients is on but no host_gpu_clients_file names "
                "the services to stop"
            )
        return settings

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _convert(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = str(f.type)
    try:
        if kind == "float":
            return float(raw)
        if kind == "int":
            return int(raw)
        if kind.startswith("tuple"):
            return tuple(x.strip() for x in raw.split(",") if x.strip())
        if kind == "bool":
            truth = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
            return truth[raw.strip().lower()]
    except (ValueError, KeyError):
        raise ConfigError(f"MIG_AGENT_{f.name.upper()}={raw!r} is not a valid {kind}") from None
    return raw


def _check_command(name: str, command: str) -> None:
    """ConfigError naming the setting when ``command`` does not split as a shell would."""
    try:
        shlex.split(command)
    except ValueError as exc:
        raise ConfigError(
            f"MIG_AGENT_{name.upper()}={command!r} is not a valid command: {exc}"
        ) from None
