"""Files that make a simulated node look like a host with NVIDIA's driver loaded, for programs
that read them beside NVML (nvidia-mig-parted: ``/proc/modules``, ``/sys/bus/pci/devices``).

``python -m migsim.nvml.hostview --state FILE --out DIR`` writes ``DIR/proc/modules`` (a line for
the ``nvidia`` module) and ``DIR/pci-devices/<0000:bb:dd.f>/`` per simulated GPU with the sysfs
files go-nvlib's ``nvpci`` reads (vendor, device, class, subsystem ids, numa_node, resource).
``sim/native/enter-host-view`` mounts them over the real paths in a private mount namespace.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from migsim.nvml import state as st

_NVIDIA_VENDOR = 0x10DE
_CLASS_3D_CONTROLLER = 0x030200  # what a data-centre GPU reports; mig-parted resets only these


def sysfs_name(bus_id: str) -> str:
    """``00000000:18:00.0`` -> ``0000:18:00.0``, the name under /sys/bus/pci/devices."""
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def write_host_view(state_file: str, out: Path) -> None:
    node = st.load_node(state_file)
    (out / "proc").mkdir(parents=True, exist_ok=True)
    (out / "proc" / "modules").write_text(
        "nvidia 104857600 0 - Live 0x0000000000000000 (POE)\n")
    devices = out / "pci-devices"
    devices.mkdir(parents=True, exist_ok=True)
    for gpu in node.gpus:
        m = gpu.model
        d = devices / sysfs_name(gpu.bus_id)
        d.mkdir(exist_ok=True)
        files = {
            "vendor": f"0x{_NVIDIA_VENDOR:04x}",
            "device": f"0x{m.pci_device_id >> 16:04x}",
            "class": f"0x{_CLASS_3D_CONTROLLER:06x}",
            "subsystem_vendor": f"0x{m.pci_subsystem_id & 0xFFFF:04x}",
            "subsystem_device": f"0x{m.pci_subsystem_id >> 16:04x}",
            "numa_node": "-1",
            # BAR0 (16 MiB registers) as the kernel lists it: start end flags.
            "resource": "0x00000000fa000000 0x00000000faffffff 0x0000000000040200\n"
                        + "0x0000000000000000 0x0000000000000000 0x0000000000000000\n" * 5,
        }
        for name, text in files.items():
            (d / name).write_text(text if text.endswith("\n") else text + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m migsim.nvml.hostview", description=__doc__)
    p.add_argument("--state", required=True)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    write_host_view(args.state, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
