"""The node agent: from the node's layout label to a repartitioned node, and back to a clean
node. ``reconcile`` holds the pass (Agent); its steps are ``node_guard`` (cordon and operands),
``device_plugin`` (restart and wait for resources), ``reporting``, ``reboot``; ``loop`` runs
passes on events, backoff and resync."""

from mig_agent.agent.outcome import Outcome, PassResult
from mig_agent.agent.reboot import REBOOT_TIMEOUT_S, run_reboot
from mig_agent.agent.reconcile import Agent, config_fingerprint

__all__ = ["REBOOT_TIMEOUT_S", "Agent", "Outcome", "PassResult", "config_fingerprint", "run_reboot"]
