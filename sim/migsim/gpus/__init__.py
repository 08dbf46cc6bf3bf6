"""Simulated GPU models: one data file per model (``<model>.yaml`` here), each value with its
source and inferred values marked, read into the simulator's own types. The simulated NVML
takes its tables from here, so the agent's catalog (mig_agent.core.gpu_models) is checked
against data it did not write."""

from migsim.gpus.catalog import MODEL_BY_PCI_ID, MODELS, extra_models, model, parse_gpu_spec
from migsim.gpus.loader import GpuDataError, load_model_file, parse_placements
from migsim.gpus.models import (
    Architecture,
    CiProfile,
    Engines,
    GiProfile,
    GpuModel,
    Inferred,
    Placement,
    Readings,
)

__all__ = [
    "MODELS",
    "MODEL_BY_PCI_ID",
    "Architecture",
    "CiProfile",
    "Engines",
    "GiProfile",
    "GpuDataError",
    "GpuModel",
    "Inferred",
    "Placement",
    "Readings",
    "extra_models",
    "load_model_file",
    "model",
    "parse_gpu_spec",
    "parse_placements",
]
