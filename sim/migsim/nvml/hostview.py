"""Files that make a simulated node look like a host with NVIDIA's driver loaded, for programs
that read them beside NVML (nvidia-mig-parted: ``/proc/modules``, ``/sys/bus/pci/devices``; the
device plugin: ``/proc/driver/nvidia-caps/mig-minors``).

``python -m migsim.nvml.hostview --state FILE --out DIR`` writes ``DIR/proc/modules`` (a line for
the ``nvidia`` module), ``DIR/proc/driver/nvidia-caps/mig-minors`` (the device minors of the MIG
capabilities, as the nvidia-caps driver lists them) and ``DIR/pci-devices/<0000:bb:dd.f>/`` per
simulated GPU with the sysfs files go-nvlib's ``nvpci`` reads (vendor, device, class, subsystem ids,
numa_node, resource). ``sim/native/enter-host-view`` mounts them over the real paths in a private
mount namespace (and an empty tmpfs on /var/lib/kubelet/device-plugins).
"""

from __future__ import annotations

import argparse
import struct
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


# The nvidia-caps driver numbers the capabilities of every GPU the driver could manage, whether MIG
# devices exist or not: `config 1`, `monitor 2`, then per GPU minor, per GPU instance id 0..14 the
# GI's `access` and its compute instances' (ids 0..7) `access`, consecutively.
MAX_GPU_INSTANCES = 15
MAX_COMPUTE_INSTANCES = 8
_MINORS_PER_GI = 1 + MAX_COMPUTE_INSTANCES
_MINORS_PER_GPU = MAX_GPU_INSTANCES * _MINORS_PER_GI


def mig_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The nvidia-caps device minor of ``gpu<minor>/gi<gi>[/ci<ci>]/access``."""
    return 3 + gpu_minor * _MINORS_PER_GPU + gi * _MINORS_PER_GI + (0 if ci is None else 1 + ci)


def mig_minors(gpu_minors: Sequence[int]) -> str:
    """The text of /proc/driver/nvidia-caps/mig-minors for GPUs with these device minors."""
    lines = ["config 1", "monitor 2"]
    for g in gpu_minors:
        for gi in range(MAX_GPU_INSTANCES):
            lines.append(f"gpu{g}/gi{gi}/access {mig_minor(g, gi)}")
            lines += [
                f"gpu{g}/gi{gi}/ci{ci}/access {mig_minor(g, gi, ci)}"
                for ci in range(MAX_COMPUTE_INSTANCES)
            ]
    return "\n".join(lines) + "\n"


def _config_space(device: int, subsystem: int) -> bytes:
    """The first 256 bytes of a GPU's PCI configuration space: ids and class, no capability list
    (so no vendor capability: not a vGPU, which is what GFD's vGPU labeler looks for)."""
    cfg = bytearray(256)
    cfg[0:4] = struct.pack("<HH", _NVIDIA_VENDOR, device)
    cfg[0x09:0x0C] = _CLASS_3D_CONTROLLER.to_bytes(3, "little")  # prog-if, subclass, class
    cfg[0x2C:0x30] = struct.pack("<HH", subsystem & 0xFFFF, subsystem >> 16)
    return bytes(cfg)


def write_host_view(state_file: str, out: Path) -> None:
    node = st.load_node(state_file)
    (out / "proc").mkdir(parents=True, exist_ok=True)
    (out / "proc" / "modules").write_text("nvidia 104857600 0 - Live 0x0000000000000000 (POE)\n")
    caps = out / "proc" / "driver" / "nvidia-caps"
    caps.mkdir(parents=True, exist_ok=True)
    # The GPU's device minor is its NVML index (nvmlDeviceGetMinorNumber of the simulator).
    (caps / "mig-minors").write_text(mig_minors([gpu.index for gpu in node.gpus]))
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
        (d / "config").write_bytes(_config_space(m.pci_device_id >> 16, m.pci_subsystem_id))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m migsim.nvml.hostview", description=__doc__)
    p.add_argument("--state", required=True)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    write_host_view(args.state, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
