"""The node agent: from the node's layout label to a repartitioned node, and back to a clean
node. ``reconcile`` holds the agent between passes (Agent); ``change_pass`` runs one pass as its
phases (``planning``, ``refusals``, ``announce``, ``drain_phase``, ``apply_phase``,
``advertise_phase``, ``finish``), over ``advertiser`` (the device plugin or NVIDIA's DRA plugin),
``guard`` (the cordon: what the node is owed, and the one decision to lift it), ``marks``
(the agent's annotations) and ``reporting``; ``loop`` runs passes on events, backoff
and resync."""

from mig_agent.agent.outcome import Outcome, PassResult
from mig_agent.agent.reboot import REBOOT_TIMEOUT_S, run_reboot
from mig_agent.agent.reconcile import Agent, config_fingerprint

__all__ = ["REBOOT_TIMEOUT_S", "Agent", "Outcome", "PassResult", "config_fingerprint", "run_reboot"]
