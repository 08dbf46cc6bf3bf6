"""What the agent owes a node it cordoned, as a record the node keeps (an annotation of the
agent's own), and the one decision made from it: may the node be schedulable now?

The record outlives the pass, the agent's pod and a relabel: a restarted agent, a new pod of
the DaemonSet or the pass after a relabel reads it and keeps the promise the pass before made
(never schedulable while what the node advertises names devices that are gone, or while a
pod the agent evicted still runs on a device that changes). Pure: the facts come in as
arguments, NVML and the API server are asked by mig_agent.agent.guard."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

RECORD_CAP = 4096  # characters: deploy/policies.py caps every annotation of the agent's at it
TEXT_CAP = 1200  # characters of each of the record's words (why, given_up_why)


@dataclass(frozen=True)
class Record:
    """What the node is owed. ``gpus`` is a digest of the GPUs' MIG layout as the advertiser
    listed it when the agent cordoned: while NVML reads another digest, only the advertiser
    restarted and proven against NVML makes the node schedulable again."""

    layout: str = ""  # the layout the pass that cordoned worked towards
    gpus: str = ""  # the digest of the GPUs as advertised at the cordon ("" none owed)
    evicted: tuple[str, ...] = ()  # "namespace/name" of pods evicted, maybe still running
    drain_since: float | None = None  # wall time of the first failed drain for ``layout``
    given_up: tuple[str, ...] = ()  # the pods a drain gave up on: no new try while one is left
    why: str = ""  # why the cordon stays, as the node says it
    # what the drain given up on last failed on (a budget, a pod stuck terminating): the later
    # passes' refusals name it, not only the pods
    given_up_why: str = ""
    # on a DRA node changed under device taints: the GPUs (UUIDs) whose devices are tainted
    # instead of a cordon (how the node is held back, not what it is owed: the taints go
    # with the last debt)
    tainted: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.gpus or self.evicted or self.drain_since is not None or self.given_up)

    def to_json(self) -> str:
        """The annotation's text, within RECORD_CAP (the admission policy's cap on the agent's
        annotations): the words cut first, then dropped; what the guard decides from is kept."""
        text = self._json(self.why[:TEXT_CAP], self.given_up_why[:TEXT_CAP])
        return text if len(text) <= RECORD_CAP else self._json("", "")

    def _json(self, why: str, given_up_why: str) -> str:
        data: dict[str, object] = {"layout": self.layout}
        if self.gpus:
            data["gpus"] = self.gpus
        if self.evicted:
            data["evicted"] = list(self.evicted)
        if self.drain_since is not None:
            data["drainSince"] = round(self.drain_since, 3)
        if self.given_up:
            data["givenUp"] = list(self.given_up)
        if why:
            data["why"] = why
        if given_up_why:
            data["givenUpWhy"] = given_up_why
        if self.tainted:
            data["tainted"] = list(self.tainted)
        return json.dumps(data, separators=(",", ":"), sort_keys=True)


class BadRecord(ValueError):
    """The annotation holds what the agent never writes."""


def parse(text: str) -> Record:
    """The record ``text`` holds; BadRecord naming what is wrong with it."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BadRecord(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("layout"), str):
        raise BadRecord("not an object with a layout")
    since = data.get("drainSince")
    if since is not None and not isinstance(since, int | float):
        raise BadRecord("drainSince is not a number")
    return Record(
        layout=data["layout"],
        gpus=_text(data, "gpus"),
        evicted=_names(data, "evicted"),
        drain_since=float(since) if since is not None else None,
        given_up=_names(data, "givenUp"),
        why=_text(data, "why"),
        given_up_why=_text(data, "givenUpWhy"),
        tainted=_names(data, "tainted", "GPU UUIDs"),
    )


def _text(data: dict[str, object], key: str) -> str:
    value = data.get(key, "")
    if not isinstance(value, str):
        raise BadRecord(f"{key} is not a string")
    return value


def _names(data: dict[str, object], key: str, what: str = "pod names") -> tuple[str, ...]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRecord(f"{key} is not a list of {what}")
    return tuple(value)


@dataclass(frozen=True)
class Owed:
    """What one pass adds to the record as it ends: the pods its drain evicted that may still
    run, a drain that failed (when its first try for the layout failed), one given up on."""

    evicted: tuple[str, ...] = ()
    drain_failed_at: float | None = None
    given_up: tuple[str, ...] = ()
    given_up_why: str = ""  # what the drain given up on failed on


def merged(record: Record, desired: str | None, owed: Owed) -> Record:
    """``record`` as this pass leaves it: what the pass owes added; what a relabel ends (the
    drain's window, its give-up) dropped. The digest of the GPUs and the pods evicted that may
    still run stay whatever the label says: only the advertiser's proof, and the pods' going,
    clear them."""
    if record.layout != desired:  # pods evicted for it may still run on GPUs the next changes
        record = Record(desired or "", record.gpus, record.evicted, tainted=record.tainted)
    since = record.drain_since
    if since is None and owed.drain_failed_at is not None:
        since = owed.drain_failed_at
    return replace(
        record,
        evicted=tuple(sorted(set(record.evicted) | set(owed.evicted))),
        drain_since=since,
        given_up=tuple(sorted(set(record.given_up) | set(owed.given_up))),
        given_up_why=owed.given_up_why or record.given_up_why,
    )


@dataclass(frozen=True)
class Facts:
    """What the agent read for the decision."""

    gpus_now: str  # the digest of the GPUs as NVML reads them ("" could not be read)
    proven: bool  # the advertiser was seen to list the GPUs as NVML reads them, this pass
    present: frozenset[str]  # of the record's pods, those still on the node
    now: float  # wall time
    give_up_s: float  # drain_give_up_s
    advertiser: str  # as a reason names it: "the device plugin"


@dataclass(frozen=True)
class Verdict:
    schedulable: bool
    record: Record | None  # what the node keeps now (None: nothing owed)
    why: str = ""  # why the cordon stays ("" schedulable)
    # a drain given up on: its pods are still there, no new try before they go or a relabel
    drain_given_up: tuple[str, ...] = field(default=())


def decide(record: Record, facts: Facts) -> Verdict:
    """May the node be schedulable now? Not while the GPUs may differ from what the advertiser
    lists (until it is proven), nor while pods the agent evicted still run, nor between the
    tries of a drain inside its give-up window."""
    gpus = "" if facts.proven or (record.gpus and record.gpus == facts.gpus_now) else record.gpus
    evicted = tuple(p for p in record.evicted if p in facts.present)
    given_up = tuple(p for p in record.given_up if p in facts.present)
    since = None if given_up else record.drain_since
    held = held_back(bool(record.tainted))
    reasons = []
    if gpus:
        reasons.append(
            f"{held} until {facts.advertiser} advertises the GPUs as they are now (they "
            "changed since it last listed them)"
        )
    if evicted:
        reasons.append(
            f"{held} while pods it evicted still run on GPUs that change: " + ", ".join(evicted)
        )
    if since is not None and facts.now - since < facts.give_up_s:
        reasons.append(
            f"the drain is retried for up to {facts.give_up_s:g} s (drain_give_up_s) from its "
            f"first failed try: {held} between tries"
        )
    else:
        since = None
    why = "; ".join(reasons)
    cause = record.given_up_why if given_up else ""
    kept = Record(record.layout, gpus, evicted, since, given_up, why, cause, record.tainted)
    return Verdict(not reasons, None if kept.empty else kept, why, given_up)


def held_back(tainted: bool) -> str:
    """How the node is held back from new work, as a reason or the drain's wait says it:
    ``tainted``, by its changing GPUs' device taints (Record.tainted), else by the cordon."""
    if tainted:
        return "the devices of the GPUs that change stay tainted"
    return "the node stays cordoned"


def drain_failing_for(record: Record, desired: str, now: float) -> float:
    """How long a drain of ``desired`` has failed: seconds since its first failed try as the
    record holds it (a restart keeps the window), 0 when none failed yet for this layout."""
    if record.layout != desired or record.drain_since is None:
        return 0.0
    return max(0.0, now - record.drain_since)
