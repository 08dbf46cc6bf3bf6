"""The advertiser's part of a change (mig_agent.agent.advertiser: the device plugin, or NVIDIA's
DRA plugin): restarted and waited for once the GPUs hold the layout; restarted all the same
when a change fails after the GPUs changed; the only step when the GPUs hold the layout and only
the listing is wrong. Whenever what it advertises may name devices that are gone, the node stays
cordoned until it advertises the GPUs as they are."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from mig_agent.agent import node_guard
from mig_agent.agent.advertiser import Advertiser
from mig_agent.agent.change import NOTE, Change, Tools, mig_layout
from mig_agent.core.errors import MigAgentError

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class AdvertisePhase:
    tools: Tools
    advertiser: Advertiser

    def after_change(
        self, change: Change, paused: list[str], old_plugins: set[str]
    ) -> dict[str, int]:
        """The GPUs hold the layout: the advertiser restarted and waited for; what it then
        advertises. Should it not come, the node stays cordoned."""
        try:
            return self.advertiser.advertise(change.node, change.models, paused, old_plugins)
        except MigAgentError as exc:
            raise node_guard.keep_cordon_for(exc, self.stays_cordoned()) from None

    def only(self, change: Change, old_plugins: set[str]) -> dict[str, int]:
        """Nothing to change on the GPUs, only the advertiser's listing: no cordon and no pause,
        the advertiser restarted and waited for. A cordon that an earlier pass left over GPUs it
        changed but never saw advertised stays until they are."""
        t = self.tools
        s = t.settings
        log.info("reconcile.advertise_only", reason="the GPUs hold the layout already")
        try:
            advertised = self.advertiser.advertise(change.node, change.models, [], old_plugins)
        except MigAgentError as exc:
            if s.cordon_annotation in change.node.annotations:
                raise node_guard.keep_cordon_for(exc, self.stays_cordoned()) from None
            raise
        node_guard.finish(t.cluster, s, t.cluster.get_node(s.node_name))
        return advertised

    def after_failure(
        self, change: Change, paused: list[str], old_plugins: set[str], exc: MigAgentError
    ) -> None:
        """``exc`` ended the change: if the GPUs may differ from what the advertiser read,
        restart it and wait for the listing (best effort); if it does not come, the cordon
        stays. Either way the reason says so."""
        if not self._gpus_touched(change):
            return
        log.warning("reconcile.readvertising", error=str(exc))
        name = self.advertiser.name
        try:
            self.advertiser.advertise(change.node, change.models, paused, old_plugins)
        except MigAgentError as err:
            node_guard.keep_cordon_for(exc, self.stays_cordoned())
            exc.context[NOTE] = (
                f"the GPUs had changed and {name} does not advertise them as they are now "
                f"({err}): the node stays cordoned until it does"
            )
            return
        exc.context[NOTE] = (
            f"the GPUs had changed: {name} was restarted and advertises them as they are now"
        )

    def stays_cordoned(self) -> str:
        return (
            f"the node stays cordoned until {self.advertiser.name} advertises the GPUs as they "
            "are now"
        )

    def _gpus_touched(self, change: Change) -> bool:
        """True when the advertiser's listing may not be what the GPUs hold: past the apply,
        or an apply that got some way (NVML says so; unreadable, assume it did), or a pass
        finishing an interrupted one whose listing is wrong now."""
        if change.gpus_changed:
            return True
        try:
            if change.apply_started:
                return mig_layout(self.tools.gpus.observe()) != mig_layout(change.observed)
            if change.interrupted:
                return not self.advertiser.advertises(change, as_listed=False)
        except MigAgentError:
            return True
        return False
