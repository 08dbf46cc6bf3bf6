"""Container images for the real node, built here: no registry is reachable, so every image a pod
of the real node runs is made on this machine and imported into the node's containerd.

* ``pause``: the pod sandbox's process, a static C program that waits for a signal
  (containerd's ``sandbox_image``).
* ``busybox``: Debian's static busybox with the applets a test workload uses (sh, sleep, cat,
  ...) and this machine's glibc, as a CUDA image carries its own: what NVIDIA's container runtime
  injects (the simulated ``libnvidia-ml.so.1`` and ``nvidia-smi``) then runs in it. Pods run it
  with ``imagePullPolicy: Never``.

Each image is an OCI layout written by ``umoci`` (one image per layout: a layout holding two tags,
imported as one, can resolve to the wrong manifest) and kept as a tar in the build cache, keyed by
what went into it, so a second build costs nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from . import scripts
from .errors import DevClusterError

TAG: Final = "mig-agent"
PAUSE: Final = f"localhost/pause:{TAG}"
BUSYBOX: Final = f"localhost/busybox:{TAG}"
BUSYBOX_BINARY: Final = Path("/bin/busybox")  # Debian's busybox-static
BUSYBOX_APPLETS: Final = ("sh", "sleep", "cat", "echo", "ls", "date", "env", "true", "kill")
GLIBC_OF: Final = Path("/bin/true")  # a program that loads the C library and nothing else
# what a real driver's libraries load beside the C library (libnvidia-ml, nvidia-smi), which a
# CUDA image carries and a program of this machine's would not bring
DRIVER_NEEDS: Final = tuple(
    Path("/lib/x86_64-linux-gnu") / n
    for n in ("libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
)
# a folder of image tars built elsewhere (``<name>.tar``), used instead of building them here
PREBUILT_ENV: Final = "MIG_AGENT_IMAGE_TARS"

PAUSE_C: Final = """\
#include <signal.h>
#include <unistd.h>
/* The pod sandbox's process: wait until told to stop. */
static void stop(int sig) { (void)sig; _exit(0); }
int main(void) {
  signal(SIGINT, stop);
  signal(SIGTERM, stop);
  for (;;) pause();
}
"""


@dataclass(frozen=True, slots=True)
class Image:
    """An image tar to import, and the reference pods name it by."""

    ref: str
    tar: Path

    @property
    def base_name(self) -> str:
        return self.ref.rsplit(":", 1)[0]


def cache_dir() -> Path:
    root = os.environ.get("MIG_AGENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mig-agent"
    )
    return Path(root) / "images"


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise DevClusterError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


def _oci_tar(ref: str, key: str, fill: Callable[[Path], None], entrypoint: Sequence[str]) -> Image:
    """The image `ref` as an OCI layout tar: built once per `key`, its root filesystem written by
    `fill`, run as `entrypoint`."""
    if shutil.which("umoci") is None:
        raise DevClusterError(
            "umoci is needed to build the real node's images (apt-get install umoci)"
        )
    name, tag = ref.rsplit("/", 1)[1].split(":")
    target = cache_dir() / f"{name}-{key[:16]}.tar"
    if target.exists():
        return Image(ref, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"image-{name}-") as work:
        layout, bundle = Path(work) / "layout", Path(work) / "bundle"
        image = f"{layout}:{tag}"
        _run(["umoci", "init", "--layout", str(layout)])
        _run(["umoci", "new", "--image", image])
        _run(["umoci", "unpack", "--image", image, str(bundle)])
        fill(bundle / "rootfs")
        _run(["umoci", "repack", "--image", image, str(bundle)])
        config = ["umoci", "config", "--image", image]
        for arg in entrypoint:
            config += ["--config.entrypoint", arg]
        _run(config)
        _run(["umoci", "gc", "--layout", str(layout)])
        partial = target.with_suffix(".partial")
        _run(["tar", "-C", str(layout), "-cf", str(partial), "."])
        partial.rename(target)
    return Image(ref, target)


def prebuilt(ref: str) -> Image | None:
    """``<name>.tar`` of the folder PREBUILT_ENV names, if there: on a machine that cannot
    build the images (the real GPU's, scripts/real-gpu-node), those built elsewhere."""
    folder = os.environ.get(PREBUILT_ENV)
    tar = Path(folder or ".") / f"{ref.rsplit('/', 1)[1].split(':')[0]}.tar"
    return Image(ref, tar) if folder and tar.is_file() else None


def pause() -> Image:
    if found := prebuilt(PAUSE):
        return found
    key = hashlib.sha256(PAUSE_C.encode()).hexdigest()

    def fill(rootfs: Path) -> None:
        src = rootfs.parent / "pause.c"
        src.write_text(PAUSE_C)
        _run(["gcc", "-static", "-O2", "-o", str(rootfs / "pause"), str(src)])
        src.unlink()

    return _oci_tar(PAUSE, key, fill, ["/pause"])


def _busybox_parts() -> tuple[list[Path], hashlib._Hash]:
    """The glibc the busybox image carries, and the digest of what goes into it."""
    if not BUSYBOX_BINARY.exists():
        raise DevClusterError(
            f"no {BUSYBOX_BINARY}: the workload image needs it (apt-get install busybox-static)"
        )
    glibc = _libraries(GLIBC_OF)
    digest = hashlib.sha256(BUSYBOX_BINARY.read_bytes())
    digest.update(" ".join(BUSYBOX_APPLETS).encode())
    for lib in glibc:
        digest.update(str(lib).encode() + lib.read_bytes())
    return glibc, digest


def _fill_busybox(rootfs: Path, glibc: list[Path]) -> None:
    (rootfs / "bin").mkdir(exist_ok=True)
    (rootfs / "tmp").mkdir(exist_ok=True)
    shutil.copy2(BUSYBOX_BINARY, rootfs / "bin" / "busybox")
    for applet in BUSYBOX_APPLETS:
        (rootfs / "bin" / applet).symlink_to("busybox")
    _copy_libraries(rootfs, glibc)


def busybox() -> Image:
    if found := prebuilt(BUSYBOX):
        return found
    glibc, digest = _busybox_parts()
    return _oci_tar(BUSYBOX, digest.hexdigest(), lambda r: _fill_busybox(r, glibc), ["/bin/sh"])


def all_images() -> list[Image]:
    return [pause(), busybox()]


GPU_WORKLOAD: Final = f"localhost/gpu-workload:{TAG}"
LDCONFIG: Final = Path("/sbin/ldconfig")  # Debian's: statically linked


def gpu_workload() -> Image:
    """The busybox image with what a CUDA base image carries for a real driver's CDI hooks: an
    ``/etc/ld.so.conf`` and ``ldconfig`` (the ``update-ldcache`` hook writes the driver's
    library folders into the container's loader cache; without them it fails the container)."""
    if found := prebuilt(GPU_WORKLOAD):
        return found
    glibc, digest = _busybox_parts()
    glibc = [*glibc, *DRIVER_NEEDS]
    digest.update(LDCONFIG.read_bytes() + " ".join(map(str, DRIVER_NEEDS)).encode())

    def fill(rootfs: Path) -> None:
        _fill_busybox(rootfs, glibc)
        (rootfs / "etc" / "ld.so.conf.d").mkdir(parents=True, exist_ok=True)
        (rootfs / "etc" / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
        (rootfs / "sbin").mkdir(exist_ok=True)
        shutil.copy2(LDCONFIG, rootfs / "sbin" / "ldconfig")

    return _oci_tar(GPU_WORKLOAD, digest.hexdigest(), fill, ["/bin/sh"])


NVIDIA_PLUGIN: Final = f"localhost/nvidia-device-plugin:{TAG}"
ENTER_HOST_VIEW: Final = scripts.REPO / "sim" / "native" / "enter-host-view"
PLUGIN_APPLETS: Final = (*BUSYBOX_APPLETS, "mount", "ln", "cp", "mkdir", "rm", "basename")


def _libraries(binary: Path) -> list[Path]:
    """The shared libraries `binary` loads, as ldd resolves them on this machine."""
    done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
    found = []
    for line in done.stdout.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0] if parts else ""
        if path.startswith("/"):
            found.append(Path(path))
    return found


def _copy_libraries(rootfs: Path, libs: Sequence[Path]) -> None:
    """`libs` at their own paths in `rootfs` (the files, not the links to them)."""
    for lib in libs:
        target = rootfs / lib.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib.resolve(), target)


def nvidia_plugin(nvidia_bin: Path, sim_nvml: Path | None) -> Image:
    """NVIDIA's device plugin and GFD (built from ../shared/upstream into `nvidia_bin`) with the
    glibc they link, the simulated ``libnvidia-ml.so.1`` from `sim_nvml` where a driver's would
    be (None: a real driver's, mounted from the host), busybox, and ``enter-host-view`` (the
    node's /proc and /sys as the driver shows them)."""
    if sim_nvml is None and (found := prebuilt(NVIDIA_PLUGIN)):
        return found
    binaries = [nvidia_bin / "nvidia-device-plugin"]
    if sim_nvml is not None:  # the simulated nodes run GFD too; a real driver's, the plugin only
        binaries.append(nvidia_bin / "gpu-feature-discovery")
    library = [sim_nvml / "libnvidia-ml.so.1"] if sim_nvml is not None else []
    for needed in (*binaries, *library, BUSYBOX_BINARY):
        if not needed.exists():
            raise DevClusterError(f"the device plugin's image needs {needed}")
    libs = sorted({lib for b in (*binaries, *library) for lib in _libraries(b)})
    if sim_nvml is None:  # a real driver's libnvidia-ml, mounted, loads these
        libs = sorted({*libs, *DRIVER_NEEDS})
    digest = hashlib.sha256()
    for path in (*binaries, *library, BUSYBOX_BINARY, ENTER_HOST_VIEW, *libs):
        digest.update(str(path).encode() + path.read_bytes())
    digest.update(" ".join(PLUGIN_APPLETS).encode())

    def fill(rootfs: Path) -> None:
        for sub in ("bin", "tmp", "usr/bin", "usr/lib", "usr/local/bin", "var/lib/kubelet"):
            (rootfs / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy2(BUSYBOX_BINARY, rootfs / "bin" / "busybox")
        for applet in PLUGIN_APPLETS:
            (rootfs / "bin" / applet).symlink_to("busybox")
        for b in binaries:
            shutil.copy2(b, rootfs / "usr" / "bin" / b.name)
        # where the dynamic loader looks without an ld.so.cache, as a driver's library is found
        for lib in library:
            shutil.copy2(lib, rootfs / "usr" / "lib" / lib.name)
        shutil.copy2(ENTER_HOST_VIEW, rootfs / "usr" / "local" / "bin" / "enter-host-view")
        _copy_libraries(rootfs, libs)

    return _oci_tar(NVIDIA_PLUGIN, digest.hexdigest(), fill, ["/bin/sh"])


AGENT: Final = "localhost/mig-agent:dev"


def agent() -> Image:
    """mig-agent's image, built from the project's Containerfile by scripts/agent-image (a base
    made from Debian's packages, buildah; cached per source version)."""
    if found := prebuilt(AGENT):
        return found
    return Image(AGENT, scripts.built("agent-image"))
