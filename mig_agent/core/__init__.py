"""The pure core: layouts, the GPUs as observed, GPU models and placements, the planner,
the label protocol, what the device plugin advertises, generated layouts, snapshots and the
errors. No I/O: values in, values out; every other layer builds on these."""
