"""The fault campaign's quick set, as CI runs it: ``bench/fault_campaign.py --quick --seed 1``.

Four trials of a 2-node FSDP2 job (simulated nodes, a peer server per node, a SQLite catalog) that
between them inject every fault kind at least once: a node killed during a save, during the commit
and during a restore; swapped node ranks; the coordination store killed; EIO on a file of the newest
checkpoint; a node past the deadline; the catalog down. The campaign checks after every trial that the
job resumed from the newest checkpoint whose bytes survive, ended bit-identical to a run without
faults, that its catalog agrees with its disks and nothing good was quarantined, and that nothing
hung; its last line counts the violations (the full campaign: 100 trials, see the script).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptflow.services import simulated_nodes

# About 5 minutes on a shared 2-core machine (7.5 under heavy load); CI's whole run is near its limit.
LIMIT_S = 540

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(LIMIT_S + 120),
    pytest.mark.skipif(simulated_nodes.unavailable() is not None, reason=str(simulated_nodes.unavailable())),
]

CAMPAIGN = Path(__file__).resolve().parents[3] / "bench" / "fault_campaign.py"


def test_the_quick_fault_campaign_finds_no_violation(tmp_path: Path) -> None:
    out = tmp_path / "campaign"
    argv = [sys.executable, str(CAMPAIGN), "--quick", "--seed", "1", "--out", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the campaign kills its nodes on SIGTERM (a SIGKILL would leave them running)
        stdout, stderr = proc.communicate(timeout=90)
        pytest.fail(f"the quick campaign ran past {LIMIT_S} s\n{stdout}\n{stderr[-4000:]}")
    done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    lines = done.stdout.strip().splitlines()
    assert lines, f"no output\n{done.stderr[-4000:]}"
    last = lines[-1]
    assert last.startswith("trials=4 "), f"{done.stdout}\n{done.stderr[-4000:]}"
    assert " violations=0 " in f" {last} ", done.stdout
    assert "resumed_newest=4/4" in last, done.stdout
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    # Every fault kind was injected at least once across the quick set.
    table = {row.split()[0]: row.split() for row in lines if row[:1].isalpha() and len(row.split()) == 5}
    for kind in ("kill-save", "kill-commit", "kill-restore", "swap", "store-kill", "eio", "deadline"):
        assert kind in table and int(table[kind][2]) >= 1, f"{kind} was not injected\n{done.stdout}"
    assert "catalog-down" in table, done.stdout
