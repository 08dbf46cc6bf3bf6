"""Errors mig_agent raises on purpose. Anything else is a bug.

* MigAgentError
  + ConfigError            the profile configs or settings are wrong; a human must fix them
    - InvalidConfig        schema or profile-name error, with file, layout and key in .context
    - UnknownLayout        the node label names a layout that is in no config file
  + PlanError              the layout cannot be realised on these GPUs (does not fit, unknown
                           profile for the model, instance in use that must go)
  + GpuError               NVML refused (.context["nvml_code"])
    - GpuBusy              processes or compute instances still hold the GPU         (retryable)
    - GpuResetRequired     MIG mode change pending; needs a GPU reset or a reboot
    - GpuUnavailable       no NVML library, driver not loaded                         (retryable)
    - GpuStepFailed        an NVML call of the plan failed part-way through           (retryable)
  + KubeError              the API refused after the client's own retries
    - KubeUnavailable      5xx, throttling or connection errors, retries used up      (retryable)
    - EvictionBlocked      eviction answered 429: a PodDisruptionBudget says no       (retryable)
    - LabelsChanged        a conditional node patch found other label values: not written
    - KubeForbidden        401/403: credentials or RBAC refuse (for seconds after an API
                           server restart; until an admin fixes a broken install)  (retryable)
  + DrainTimeout           GPU clients still present at the deadline                  (retryable)
  + DevicePluginTimeout    the node's resources do not match the layout in time       (retryable)
    - DraPluginTimeout     on a DRA node: the node's ResourceSlice does not list the
                           layout's devices in time                                   (retryable)
  + DevicePluginMissing    no device plugin pod where the settings look, on a node that is
                           no DRA node: refused before anything is touched          (retryable)
  + DraPluginMissing       NVIDIA's DRA driver publishes the node's GPUs but no pod of its
                           kubelet plugin is where the settings look: refused before anything
                           is touched, as it could not be restarted after a change   (retryable)
  + RebootFailed           the configured reboot command failed or did not return
  + HookFailed             a hook (mig-parted hooks file, pre/post-apply command) failed or
                           did not finish in time; its output (trimmed) in the message
  + HostServiceFailed      a host GPU client service could not be stopped or started again
                                                                                      (retryable)
  + DrainRefused           a GPU pod the drain must not evict: one no controller owns (gone for
                           good once evicted), or a DaemonSet's that would come straight back;
                           refused before the cordon, naming the pods                 (retryable)
    - EvictionUnsupported  an eviction the API server refuses for good: more than one
                           PodDisruptionBudget covers the pod (HTTP 500); no retry of the
                           request ends it, the budgets' owner must     (retryable by the agent)
  + InternalError          an exception that is none of these (a bug): the pass undoes its
                           marks, reports it and backs off rather than the agent dying (retryable)
  + ObserveOnlyRefused     a change asked of a GPU backend opened read-only, or of the cluster
                           in observe mode: refused before anything is called (a bug: the
                           observe pass asks for none)

* Stopping (not a MigAgentError): raised out of a wait inside a pass when the agent is told to
  stop (SIGTERM); the pass undoes its marks and the agent exits.

Leaf module: imports nothing from mig_agent.
"""

from __future__ import annotations

from typing import ClassVar


class MigAgentError(Exception):
    """Base of every error raised on purpose; ``context`` holds structured fields for logs."""

    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **context: object) -> None:
        super().__init__(message)
        self.context: dict[str, object] = context


class ConfigError(MigAgentError):
    pass


class InvalidConfig(ConfigError):
    pass


class UnknownLayout(ConfigError):
    pass


class PlanError(MigAgentError):
    pass


class GpuError(MigAgentError):
    pass


class GpuBusy(GpuError):
    retryable = True


class GpuResetRequired(GpuError):
    pass


class GpuStepFailed(GpuError):
    """An NVML call of a plan failed part-way through: the GPU may hold part of the change (an
    instance created or destroyed though NVML said no); a later pass plans again from what NVML
    then reports."""

    retryable = True


class GpuUnavailable(GpuError):
    retryable = True


class KubeError(MigAgentError):
    pass


class KubeUnavailable(KubeError):
    retryable = True


class EvictionBlocked(KubeError):
    retryable = True


class PodReplaced(KubeError):
    """An eviction's pod is gone and another pod has its name (a StatefulSet, a rollout): the
    drain reads the new one and decides again."""

    retryable = True


class KubeForbidden(KubeError):
    """Retried by the agent's back-off, not within the request: a restarted API server
    refuses a valid token until its caches fill, and a fixed RBAC must heal the node
    without a relabel."""

    retryable = True


class DrainTimeout(MigAgentError):
    retryable = True


class DrainGivenUp(MigAgentError):
    """A drain retried for ``drain_give_up_s``: no new try until the pods it waited on are gone
    or the label or the config changes (the node stays cordoned while a pod it evicted still
    runs on a GPU that changes)."""


class DevicePluginTimeout(MigAgentError):
    retryable = True


class DraPluginTimeout(DevicePluginTimeout):
    """NVIDIA's DRA kubelet plugin did not publish the layout's devices in time: a new plugin
    pod did not run, or the node's ResourceSlice lists other devices."""


class DevicePluginMissing(MigAgentError):
    """No device plugin pod on the node where the settings look: none would advertise a new
    layout, so the change is refused before anything is touched."""

    retryable = True


class DraPluginMissing(MigAgentError):
    retryable = True


class LabelsChanged(KubeError):
    """A patch conditional on label values was not written: the labels differ now."""


class RebootFailed(MigAgentError):
    pass


class HookFailed(MigAgentError):
    """A hook command failed: a human fixes the command, then relabels (or restarts the agent)."""


class HostServiceFailed(MigAgentError):
    retryable = True


class DrainRefused(MigAgentError):
    retryable = True


class EvictionUnsupported(DrainRefused):
    """The API server refuses to evict the pod whatever the timing: more than one
    PodDisruptionBudget covers it (``pod``; ``pdbs``, namespace/name, where they could be
    listed). Raised at the first answer; the drain stops there, as for any refused drain, and
    what it had evicted before is in ``refs``."""


class InternalError(MigAgentError):
    retryable = True


class ObserveOnlyRefused(MigAgentError):
    """A mutating call refused because the agent only observes (``mig-agent run --observe``):
    the NVML adapter opened read-only refuses every call that changes a GPU, and the observe
    pass's cluster every write but its Event and its own annotation."""


class Stopping(Exception):  # noqa: N818 (a signal to stop, not an error)
    """The agent was told to stop while a pass waited; ``refs``: the pods the drain had
    evicted that were still terminating (their cordon stays for the agent's successor)."""

    def __init__(self, refs: tuple[object, ...] = ()) -> None:
        super().__init__()
        self.refs = refs


class LeadershipLost(MigAgentError):
    """A replica that no longer surely holds its Lease was about to write: the round stops
    there, and the next leader carries on from what is on the objects."""
