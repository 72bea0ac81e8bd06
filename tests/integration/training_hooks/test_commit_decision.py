"""The commit is decided once, and what is decided stands, on two nodes (one rank each, each node its
own hot root) with real processes, a real TCPStore and a SQLite catalog.

- The coordinator delayed past deadline + grace between its checks and its decision: the other node
  gives up and decides "abandoned" first; the coordinator reads that decision instead of publishing
  its own "committed", so both nodes record the same outcome and neither keeps a part. Before the
  compare-and-set, rank 0 recorded committed and posted the staged event while node 1 abandoned and
  removed its part.
- The coordination store killed right after the decision: the catalog ends ``committed`` with the
  staged event in its outbox (what reconcile delivers: the step is promoted), every node keeps its
  part, and a fresh restore takes the step. Before, the lost store turned the save into ABANDONED in
  the catalog though every node held its manifest.
- A node whose disk turns slow past the deadline: that save is abandoned on both nodes, the straggler
  stops writing once it reads the decision, and at most the one following save is skipped as busy;
  the saves after it commit. Before, the straggler wrote to its end (its rank busy all along) and the
  leader waited for it up to max(600 s, 10 x deadline), every save of the job skipped meanwhile.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptflow.catalog import Catalog, CheckpointState
from ckptflow.storage import layout
from ckptflow.storage.events import STAGED_EVENT
from ckptflow.storage.manifest import MANIFEST_NAME

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[1] / "commit_worker.py"
RUN = "decided"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _launch(tmp: Path, name: str, scenario: str, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    out = tmp / f"out-{name}"
    out.mkdir()
    procs = []
    for rank in range(2):
        argv = [sys.executable, str(WORKER), "--rank", str(rank), "--init-file", str(tmp / f"init-{name}")]
        argv += ["--root", str(tmp / "node{rank}"), "--catalog", f"sqlite:///{tmp / 'catalog.db'}"]
        argv += ["--out", str(out), "--scenario", scenario, "--signals", str(tmp)]
        log = (tmp / f"{name}-rank{rank}.log").open("wb")
        procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        )
    return procs


def _finish(tmp: Path, name: str, procs: list[subprocess.Popen]) -> list[dict]:
    for rank, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{name}: rank {rank} did not finish\n{_logs(tmp, name)}") from None
        assert code == 0, f"{name}: rank {rank} exited {code}\n{_logs(tmp, name)}"
    return [json.loads((tmp / f"out-{name}" / f"rank{r}.json").read_text()) for r in range(2)]


def _logs(tmp: Path, name: str) -> str:
    return "\n".join((tmp / f"{name}-rank{r}.log").read_text()[-4000:] for r in range(2))


def _rows(tmp: Path, step: int) -> list:
    catalog = Catalog.open(f"sqlite:///{tmp / 'catalog.db'}")
    try:
        return catalog.attempts_at(RUN, step)
    finally:
        catalog.dispose()


def test_a_coordinator_past_deadline_and_grace_and_the_node_that_gave_up_record_one_outcome(
    tmp_path: Path,
) -> None:
    results = _finish(tmp_path, "delayed", _launch(tmp_path, "delayed", "delayed"))
    assert [r["outcomes"]["5"] for r in results] == ["abandoned", "abandoned"], _logs(tmp_path, "delayed")
    assert [r["outcomes"]["6"] for r in results] == ["committed", "committed"]
    (row,) = _rows(tmp_path, 5)
    assert row.state == CheckpointState.ABANDONED and "gave up waiting" in (row.reason or "")
    for node in range(2):
        run_dir = tmp_path / f"node{node}" / RUN
        assert layout.committed_steps(run_dir) == [6]  # no step-5 anywhere, decided or not
        assert not (run_dir / "step-5").exists()


def test_a_store_lost_after_the_decision_leaves_the_checkpoint_committed_and_announced(
    tmp_path: Path,
) -> None:
    port = _free_port()
    host_script = (
        "import datetime, time, torch.distributed as d; "
        f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False, "
        "timeout=datetime.timedelta(seconds=30)); print('up', flush=True); time.sleep(600)"
    )
    store = subprocess.Popen([sys.executable, "-c", host_script], stdout=subprocess.PIPE)
    assert store.stdout is not None and store.stdout.readline().strip() == b"up"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = _launch(tmp_path, "lost", "store-lost", env)
    deadline = time.monotonic() + 120
    while not (tmp_path / "decided").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _logs(tmp_path, "lost")
        time.sleep(0.05)
    store.kill()  # the host of the coordination store dies, right after the decision
    store.wait()
    (tmp_path / "killed").touch()
    results = _finish(tmp_path, "lost", procs)
    assert results[0]["outcomes"]["5"] == "committed", _logs(tmp_path, "lost")
    (row,) = _rows(tmp_path, 5)
    assert row.state == CheckpointState.COMMITTED, (row.state, row.reason)
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        staged = [e for e in catalog.undelivered_events(100) if e.kind == STAGED_EVENT and e.step == 5]
    finally:
        catalog.dispose()
    assert staged, "the staged event must wait in the outbox for reconcile (no Prefect here)"
    assert (tmp_path / "node0" / RUN / "step-5" / MANIFEST_NAME).is_file()
    assert (tmp_path / "node1" / RUN / "step-5").is_dir()  # its part, decided or kept for restore
    restored = _finish(tmp_path, "restore", _launch(tmp_path, "restore", "restore"))
    assert [r["restored"] for r in restored] == [5, 5]
    assert (tmp_path / "node1" / RUN / "step-5" / MANIFEST_NAME).is_file()  # the decision written back


def test_a_node_slowed_past_the_deadline_costs_at_most_the_one_following_save(tmp_path: Path) -> None:
    results = _finish(tmp_path, "slow", _launch(tmp_path, "slow", "slow"))
    logs = _logs(tmp_path, "slow")
    for result in results:
        assert result["outcomes"]["5"] == "abandoned", (result, logs)
        assert result["skipped_busy"] <= 1, (result, logs)
        assert result["started"]["7"] and result["started"]["8"], (result, logs)
        assert result["outcomes"]["7"] == "committed" and result["outcomes"]["8"] == "committed", (
            result,
            logs,
        )
    assert results[0]["started"] == results[1]["started"]  # every rank takes the same skip decision
    (row,) = _rows(tmp_path, 5)
    assert row.state == CheckpointState.ABANDONED
    for node in range(2):
        run_dir = tmp_path / f"node{node}" / RUN
        assert not (run_dir / "step-5").exists()
        assert {7, 8} <= set(layout.committed_steps(run_dir))
        # nothing of the abandoned attempt is left once the leader's next save has run
        assert not [p for p in run_dir.iterdir() if p.name.startswith("step-5.")], sorted(run_dir.iterdir())
