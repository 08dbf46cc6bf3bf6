"""Where the agent's catalog (mig_agent.core.gpu_models) and the simulator's GPU data
(sim/migsim/gpus, written from the reference documents) disagree, and the references do not settle
which side is right: (model key, aspect) -> what each side says and why it stays open. Tests that
compare the two mark these xfail(strict=True), so a fix on either side fails them until its entry
here is removed."""

from __future__ import annotations

from collections.abc import Mapping

# Settled since: CI profile 0 in a 1g REV2 GPU instance is one compute slice (16 SMs on H100/H200,
# 18 on Blackwell), the whole GI being CI profile 7 (nvml-mig.md 4, read out on a B300): the
# catalog gave profile 0 the whole GI's SMs and was fixed.

FINDINGS: Mapping[tuple[str, str], str] = {
    ("A100-40GB", "memory_total_mib"): (
        "parent memory total: the catalog has 40536 MiB, the simulator 40537, which nvml-mig.md "
        "3.1 gives as printed by nvidia-smi (MIG User Guide); its 2.6 works the name formula with "
        "40536. Both give the same profile names"
    ),
}
