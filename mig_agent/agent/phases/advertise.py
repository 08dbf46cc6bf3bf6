"""The advertiser's part of a change (mig_agent.agent.advertisers: the device plugin, or
NVIDIA's DRA plugin): restarted and waited for once the GPUs hold the layout; the only step
when the GPUs hold the layout and only the listing is wrong. Whenever what it advertises may
name devices that are gone, the guard (mig_agent.agent.guard) keeps the node cordoned until it
advertises the GPUs as they are."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from mig_agent.agent import guard
from mig_agent.agent.advertisers.advertiser import Advertiser
from mig_agent.agent.change import Change, Tools

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class AdvertisePhase:
    tools: Tools
    advertiser: Advertiser

    def after_change(
        self, change: Change, paused: list[str], old_plugins: set[str]
    ) -> dict[str, int]:
        """The GPUs hold the layout: the advertiser restarted and waited for; what it then
        advertises. Should it not come, the guard keeps the node cordoned."""
        return self.advertiser.advertise(change.node, change.models, paused, old_plugins)

    def only(self, change: Change, old_plugins: set[str]) -> dict[str, int]:
        """Nothing to change on the GPUs, only the advertiser's listing: no cordon and no pause,
        the advertiser restarted and waited for. A cordon that an earlier pass left over GPUs it
        changed but never saw advertised stays until they are (guard.settle)."""
        t = self.tools
        log.info("reconcile.advertise_only", reason="the GPUs hold the layout already")
        advertised = self.advertiser.advertise(change.node, change.models, [], old_plugins)
        guard.settle(t, change.desired, succeeded=True, dra_node=change.dra)
        return advertised
