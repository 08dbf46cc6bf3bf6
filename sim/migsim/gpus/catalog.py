"""The simulated GPU models, loaded once from the data files of this folder, and GPU specs
("8xH200", "4xA100-40GB,4xA30") read by model key. ``extra_models`` adds the models of other
files for a while (a test's own model, one no catalog knows)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType

from migsim.gpus.loader import GpuDataError, load_model_file, load_models
from migsim.gpus.models import GpuModel

DATA = Path(__file__).resolve().parent

_MODELS: dict[str, GpuModel] = load_models(DATA)
_BY_PCI_ID: dict[int, GpuModel] = {m.pci_device_id: m for m in _MODELS.values()}
MODELS: Mapping[str, GpuModel] = MappingProxyType(_MODELS)
MODEL_BY_PCI_ID: Mapping[int, GpuModel] = MappingProxyType(_BY_PCI_ID)

_PART = re.compile(r"(?:(?P<count>\d+)x)?(?P<key>\S+)")


@contextmanager
def extra_models(*paths: Path) -> Iterator[tuple[GpuModel, ...]]:
    """The models (and variants) of the files at ``paths``, known beside this folder's until the
    block ends, in this process only: GPU specs name them by key, simulated GPUs of them answer
    NVML. GpuDataError for a file that does not load, or a model with a known key or PCI id."""
    added: list[GpuModel] = []
    try:
        for path in paths:
            for m in load_model_file(path):
                clash = next(
                    (o for o in _MODELS.values() if o.key.lower() == m.key.lower()),
                    _BY_PCI_ID.get(m.pci_device_id),
                )
                if clash is not None:
                    raise GpuDataError(f"{path.name}: {m.key} has the key or PCI id of {clash.key}")
                _MODELS[m.key] = _BY_PCI_ID[m.pci_device_id] = m
                added.append(m)
        yield tuple(added)
    finally:
        for m in added:
            del _MODELS[m.key], _BY_PCI_ID[m.pci_device_id]


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
