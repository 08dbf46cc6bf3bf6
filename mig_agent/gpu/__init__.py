"""The GPU boundary: one backend protocol, one NVML adapter, a simulated NVML library beneath it."""
