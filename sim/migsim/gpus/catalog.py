"""The simulated GPU models, loaded once from the data files of this folder, and GPU specs
("8xH200", "4xA100-40GB,4xA30") read by model key."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from migsim.gpus.loader import load_models
from migsim.gpus.models import GpuModel

DATA = Path(__file__).resolve().parent

MODELS: Mapping[str, GpuModel] = load_models(DATA)
MODEL_BY_PCI_ID: Mapping[int, GpuModel] = {m.pci_device_id: m for m in MODELS.values()}

_PART = re.compile(r"(?:(?P<count>\d+)x)?(?P<key>\S+)")


def model(key: str) -> GpuModel:
    """The model called ``key`` (case-insensitive); ValueError naming the known keys."""
    found = next((m for k, m in MODELS.items() if k.lower() == key.lower()), None)
    if found is None:
        raise ValueError(f"unknown GPU model {key!r}; known models: {', '.join(MODELS)}")
    return found


def parse_gpu_spec(spec: str) -> tuple[GpuModel, ...]:
    """One model per GPU, in order: ``8xH100-80GB``, ``2xA100-40GB,2xA30`` or ``H200``."""
    out: list[GpuModel] = []
    for part in (p.strip() for p in spec.split(",")):
        m = _PART.fullmatch(part)
        if m is None:
            raise ValueError(f"not a GPU spec part like '8xH200': {part!r} in {spec!r}")
        count = int(m["count"] or 1)
        if count < 1:
            raise ValueError(f"bad GPU count in {part!r}")
        out += [model(m["key"])] * count
    return tuple(out)
