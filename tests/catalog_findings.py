"""Where the agent's catalog (mig_agent.core.gpu_models) and the simulator's GPU data
(sim/migsim/gpus, written from the reference documents) disagree, and the references do not settle
which side is right: (model key, aspect) -> what each side says and why it stays open. Tests that
compare the two mark these xfail(strict=True), so a fix on either side fails them until its entry
here is removed."""

from __future__ import annotations

from collections.abc import Mapping

_HOPPER_REV2_CI = (
    "CI profile 0 in the 1g REV2 GPU instance (1g.20gb / 1g.24gb / 1g.35gb): the catalog gives it "
    "the GI's 26 SMs, the simulator one compute slice's 16 (nvml-mig.md 4: 1_SLICE is one compute "
    "slice, 16 SMs on H100/H200; 1_SLICE_REV1 = 7 is the whole GI, 26; read out on a B300, the "
    "H100/H200 values marked [I])"
)

FINDINGS: Mapping[tuple[str, str], str] = {
    ("A100-40GB", "memory_total_mib"): (
        "parent memory total: the catalog has 40536 MiB, the simulator 40537, which nvml-mig.md "
        "3.1 gives as printed by nvidia-smi (MIG User Guide); its 2.6 works the name formula with "
        "40536. Both give the same profile names"
    ),
    ("H100-80GB", "ci_profiles_1g_rev2"): _HOPPER_REV2_CI,
    ("H100-NVL", "ci_profiles_1g_rev2"): _HOPPER_REV2_CI,
    ("H200", "ci_profiles_1g_rev2"): _HOPPER_REV2_CI,
}
