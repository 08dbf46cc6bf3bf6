"""The node agent: from the node's layout label to a repartitioned node, and back to a clean
node. ``reconcile`` holds the agent between passes (Agent); ``change_pass`` runs one pass as
its phases (the ``phases`` package: planning, refusals, announce, drain, apply, advertise,
finish), over the ``advertisers`` package (the device plugin or NVIDIA's DRA plugin), the node
guard (``guard``: the cordon, what the node is owed, and the one decision to lift it),
``marks`` (the agent's annotations) and ``reporting``; ``loop`` runs passes on events, backoff
and resync; ``observe`` is observe mode; ``host_clients`` the host services a reset stops."""

from mig_agent.agent.outcome import Outcome, PassResult
from mig_agent.agent.phases.reboot import REBOOT_TIMEOUT_S, run_reboot
from mig_agent.agent.reconcile import Agent, config_fingerprint

__all__ = ["REBOOT_TIMEOUT_S", "Agent", "Outcome", "PassResult", "config_fingerprint", "run_reboot"]
