"""We test `scripts/demo --kueue`, the README's command: on a local cluster of its own (one
simulated H100 node at all-1g.10gb, its agent, Kueue's controller), a Job of two pods asking one
nvidia.com/mig-3g.40gb each waits on the MIG layout AdmissionCheck; `mig-agent admission-check`
relabels the node to all-3g.40gb, the agent reaches success, Kueue admits the Job and both pods
run on the node; the demo stops what it started."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_kueue_demo_admits_a_queued_job_after_a_relabel() -> None:
    done = subprocess.run(
        [str(REPO / "scripts" / "demo"), "--kueue"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, (out[-3000:], done.stderr[-3000:])
    before, _, after = out.partition("== mig-agent admission-check in the background")
    assert after, out
    # queued: the Job suspended, its Workload holding quota but waiting on the check
    assert "job/train: suspended=true" in before, out
    assert re.search(r"QuotaReserved=True, Admitted=False; check mig-layout: Pending", before), out
    assert "gpu-node-0: nvidia.com/mig.config=all-1g.10gb" in before, out
    # the relabel the check made, the agent at success with the new devices
    assert "Relabel: relabelling gpu-node-0 to all-3g.40gb for it" in after, out
    assert re.search(r"gpu-node-0: nvidia.com/mig.config=all-3g.40gb; \S+: .*-> success\n", after)
    assert "gpu-node-0: devices {'nvidia.com/mig-3g.40gb': '2'}" in after, out
    # admitted, unsuspended, both pods Running on the relabelled node
    assert "check mig-layout: Ready: its 2 pod(s) fit on gpu-node-0" in after, out
    assert "job/train: suspended=false" in after, out
    pods = re.findall(r"^pod/(train-\S+) on (\S+) .*: (.*)$", after, re.M)
    assert len(pods) == 2 and len({p[0] for p in pods}) == 2, out
    assert all(on == "gpu-node-0" and "Running" in phases.split(" -> ") for _, on, phases in pods)
    assert "== mig-agent admission-check stopped" in after, out
    # mig-agent status: the pool after
    assert re.search(
        r"^gpu-node-0\s+all-3g\.40gb\s+success\s+1xH100-80GB\s+mig-3g\.40gb=2", out, re.M
    )
    dirs = re.findall(r"export KUBECONFIG=(\S+)/admin\.kubeconfig", out + done.stderr)
    assert dirs and not Path(dirs[0]).exists(), "the demo left its cluster's folder"
