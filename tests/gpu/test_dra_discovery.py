"""What NVIDIA's DRA driver (gpu-kubelet-plugin) reads when it discovers the GPUs, beyond what the
device plugin and mig-parted read: the brand and the addressing mode, as real NVML answers them.

These tests also run over the C face (tests/native/test_c_face.py imports them)."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from types import ModuleType

import pynvml
import pytest
from migsim.gpus import MODELS
from migsim.nvml.state import ARGUMENT_VERSION_MISMATCH, INVALID_ARGUMENT

from .conftest import CAPTURES, MakeNode

NvmlOn = Callable[[str], ModuleType]


def _smi_q_field(name: str) -> str:
    """A GPU field of the captured ``nvidia-smi -q`` of the real H200."""
    text = (CAPTURES / "h200-nvidia-smi-q-2026-12-01.txt").read_text()
    found = re.search(rf"^\s+{re.escape(name)}\s+: (.+)$", text, re.MULTILINE)
    assert found, name
    return found.group(1).strip()


# nvidia-smi's names of the NVML_BRAND_* values these tests meet
SMI_BRANDS = {"NVIDIA": pynvml.NVML_BRAND_NVIDIA, "NVIDIA RTX": pynvml.NVML_BRAND_NVIDIA_RTX}
SMI_ADDRESSING = {"None": pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE}


def test_h200_brand_and_addressing_mode_as_captured(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H200"))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetBrand(h) == SMI_BRANDS[_smi_q_field("Product Brand")]
    assert nv.nvmlDeviceGetAddressingMode(h) == SMI_ADDRESSING[_smi_q_field("Addressing Mode")]


@pytest.mark.parametrize(
    ("gpus", "brand"),
    [
        ("H100-80GB", pynvml.NVML_BRAND_NVIDIA),
        ("A100-40GB", pynvml.NVML_BRAND_NVIDIA),
        ("B200", pynvml.NVML_BRAND_NVIDIA),
        ("RTX-PRO-6000", pynvml.NVML_BRAND_NVIDIA_RTX),
    ],
)
def test_brand_comes_from_the_model_data(
    make_node: MakeNode, nvml_on: NvmlOn, gpus: str, brand: int
) -> None:
    nv = nvml_on(make_node(f"2x{gpus}"))
    for i in range(2):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        assert nv.nvmlDeviceGetBrand(h) == brand == MODELS[gpus].brand.nvml_code


def test_a_mig_device_reports_its_parents_brand(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H100-80GB"))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceSetMigMode(h, nv.NVML_DEVICE_MIG_ENABLE)
    profile = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, nv.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    gi = nv.nvmlDeviceCreateGpuInstance(h, profile.id)
    ci_profile = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, nv.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert nv.nvmlDeviceGetBrand(mig) == nv.nvmlDeviceGetBrand(h) == nv.NVML_BRAND_NVIDIA


def test_addressing_mode_checks_its_struct_version(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H100-80GB"))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetAddressingMode(h) == nv.NVML_DEVICE_ADDRESSING_MODE_NONE
    fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetAddressingMode")
    mode = nv.c_nvmlDeviceAddressingMode_t()
    mode.version = 0
    assert fn(h, ctypes.byref(mode)) == ARGUMENT_VERSION_MISMATCH
    mode = nv.c_nvmlDeviceAddressingMode_t()
    mode.value = 7
    assert fn(None, ctypes.byref(mode)) == INVALID_ARGUMENT
    assert mode.value == 7  # nothing written
