"""The real node's CDI spec (kind ``nvidia.com/gpu``), written from its simulated GPUs and kept
current while the node runs.

NVIDIA's ``nvidia-ctk cdi generate`` finds no driver files and no ``/dev/nvidia*`` here, so the
spec is the simulator's: a device per GPU and per MIG device, by index and by UUID, and ``all``.
Where NVIDIA's spec mounts the driver's libraries, ``nvidia-smi`` and device nodes, this one mounts
the simulated ``libnvidia-ml.so.1``, the simulated ``nvidia-smi``, the simulator's
``gpu-workload`` (a stand-in for a CUDA program: it holds the devices it sees until it exits) and
the node's GPU simulator socket; in place of a device node, each device mounts a marker file
named by its UUID into ``/run/migsim-visible``, from which the simulated library shows a
container only the devices it was given (as a real container sees only the device nodes it
was given).

A MIG device exists only once the agent creates it, so ``python -m migsim.cluster.cdi`` runs beside
the node and writes the spec again whenever the node's GPU state file changes (a real node's
spec is generated again after a repartition): a pod given a new MIG device under the RuntimeClass
``nvidia`` then finds its device in the spec.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

KIND: Final = "nvidia.com/gpu"
VISIBLE_DIR: Final = "/run/migsim-visible"  # the simulated library's contract (sim/native)
LIBRARY_PATH: Final = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
SMI_PATH: Final = "/usr/bin/nvidia-smi"
WORKLOAD_PATH: Final = "/usr/bin/gpu-workload"
ALL: Final = "all"


def device_names(state: Mapping[str, Any]) -> list[tuple[list[str], str]]:
    """Per CDI device: the names it goes by, and the UUID it makes visible (``all`` for all)."""
    out: list[tuple[list[str], str]] = []
    for gpu in state["gpus"]:
        out.append(([str(gpu["index"]), gpu["uuid"]], gpu["uuid"]))
        migs = [ci for gi in gpu["gpu_instances"] for ci in gi["compute_instances"]]
        for i, ci in enumerate(m for m in migs if m.get("uuid")):
            out.append(([f"{gpu['index']}:{i}", ci["uuid"]], ci["uuid"]))
    out.append(([ALL], ALL))
    return out


def spec(
    state: Mapping[str, Any], *, sim_nvml_dir: Path, socket: Path, markers: Path
) -> dict[str, Any]:
    """The spec for `state` (the node's GPU state file, parsed)."""

    def bind(host: Path, container: str, mode: str = "ro") -> dict[str, Any]:
        return {
            "hostPath": str(host),
            "containerPath": container,
            "options": [mode, "nosuid", "nodev", "bind"],
        }

    devices = [
        {
            "name": name,
            "containerEdits": {"mounts": [bind(markers / uuid, f"{VISIBLE_DIR}/{uuid}")]},
        }
        for names, uuid in device_names(state)
        for name in names
    ]
    mounts = [bind(sim_nvml_dir / "libnvidia-ml.so.1", LIBRARY_PATH)]
    if (sim_nvml_dir / "nvidia-smi").exists():
        mounts.append(bind(sim_nvml_dir / "nvidia-smi", SMI_PATH))
    if (sim_nvml_dir / "gpu-workload").exists():
        mounts.append(bind(sim_nvml_dir / "gpu-workload", WORKLOAD_PATH))
    mounts.append(bind(socket.parent, str(socket.parent), "rw"))
    return {
        "cdiVersion": "0.5.0",
        "kind": KIND,
        "devices": devices,
        "containerEdits": {"env": [f"MIG_AGENT_SIM_NVML_SOCKET={socket}"], "mounts": mounts},
    }


def write(state_file: Path, target: Path, *, sim_nvml_dir: Path, socket: Path) -> list[str]:
    """Write the spec for the state in `state_file` to `target` (renamed into place, so the
    runtime never reads half a spec); marker files first, in ``visible/`` beside it. Returns the
    device names written."""
    state = json.loads(state_file.read_text())
    markers = target.parent / "visible"
    markers.mkdir(parents=True, exist_ok=True)
    for _, uuid in device_names(state):
        (markers / uuid).touch()
    written = spec(state, sim_nvml_dir=sim_nvml_dir, socket=socket, markers=markers)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(written, indent=1))
    partial.rename(target)
    return [d["name"] for d in written["devices"]]


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m migsim.cluster.cdi", description=__doc__)
    p.add_argument("--state", type=Path, required=True, help="the node's GPU state file")
    p.add_argument("--out", type=Path, required=True, help="the CDI spec to keep current")
    p.add_argument("--sim-nvml", type=Path, required=True, help="scripts/sim-nvml's folder")
    p.add_argument("--socket", type=Path, required=True, help="the node's GPU simulator socket")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between looks")
    args = p.parse_args(argv)
    seen: tuple[int, int] | None = None
    names: list[str] = []
    while True:
        stamp = _stamp(args.state)
        if stamp is not None and stamp != seen:
            try:
                now = write(args.state, args.out, sim_nvml_dir=args.sim_nvml, socket=args.socket)
            except (OSError, ValueError, KeyError):
                pass  # a state file being replaced: the next look reads it whole
            else:
                seen = stamp
                if now != names:
                    print(f"cdi spec: {len(now)} device names", flush=True)
                    names = now
        time.sleep(args.interval)


if __name__ == "__main__":
    raise SystemExit(main())
