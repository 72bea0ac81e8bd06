"""The catalog tells the truth after a SIGKILL mid-save, once the job restarts.

A real training process (tests/fault/catalog_kill_worker.py) restores, starts saving step 5 and
SIGKILLs itself at the chosen moment of the save (its ``on_phase``/``write_hook``: the kill lands
exactly there, and nothing after it runs):

- at "catalog" (the checkpoint is renamed into place, the catalog write not yet made): the row
  stays ``writing``. The restart's restore verifies that checkpoint and must record the commit
  first (row committed then verified, file list, hot replica READY, a staged outbox row for
  reconcile), never log an illegal writing -> verified.
- at "manifest" or while writing shards (a partial directory, the row ``writing``): the restart
  removes the stale partial directory and the row becomes ``abandoned``. On two nodes (two ranks,
  each with its own hot root) the directory left on node 1 is removed by node 1's leader, and rank
  0, which holds the catalog, learns of it through restore's gather.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ckptflow.catalog import Catalog, CheckpointState, ReplicaState
from ckptflow.storage import layout
from ckptflow.storage.checksums import checksum_bytes
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest
from ckptflow.training_hooks import Checkpointer, CheckpointOptions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER = Path(__file__).resolve().parents[1] / "catalog_kill_worker.py"
RUN = "killed"
STEP = 5


def _launch(world: int, root: str, url: str, work: Path, *extra: str) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    init = work / f"init-{uuid.uuid4().hex}"
    procs = []
    for rank in range(world):
        cmd = [sys.executable, str(WORKER), "--root", root, "--catalog", url, "--rank", str(rank)]
        cmd += ["--world", str(world), "--init-file", str(init), *extra]
        log = (work / f"worker-{uuid.uuid4().hex[:8]}-rank{rank}.log").open("wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs


def _finish(procs: list[subprocess.Popen[bytes]], work: Path, expected: int) -> None:
    codes = [p.wait(timeout=300) for p in procs]
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(work.glob("worker-*.log")))
    assert codes == [expected] * len(procs), f"exit codes {codes}\n{logs}"


def _rows(url: str) -> list:
    catalog = Catalog.open(url)
    try:
        return [(cp, catalog.replicas(cp.id), catalog.files(cp.id)) for cp in catalog.checkpoints(RUN)]
    finally:
        catalog.dispose()


def _restore_here(hot: Path, url: str, stale_age: float = 60.0) -> int:
    """Restore the run, as the worker does, from the hot tier root ``hot``."""
    from catalog_kill_worker import build_state  # noqa: PLC0415 - the worker's state, built here

    with Checkpointer(
        RUN, hot, catalog=url, options=CheckpointOptions(stale_partial_age_s=stale_age)
    ) as ckpt:
        return ckpt.restore(build_state())


def test_a_kill_before_the_catalog_write_is_recorded_by_the_next_restore(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hot, url = tmp_path / "hot", f"sqlite:///{tmp_path / 'catalog.db'}"
    _finish(_launch(1, str(hot), url, tmp_path, "--kill-at", "catalog"), tmp_path, -signal.SIGKILL)
    directory = hot / RUN / layout.committed_name(STEP)
    manifest = read_manifest(directory)  # renamed into place before the kill
    ((cp, replicas, _),) = _rows(url)
    assert (cp.state, cp.save_id, replicas) == (CheckpointState.WRITING, manifest.save_id, [])

    with caplog.at_level(logging.INFO, logger="ckptflow"):
        assert _restore_here(hot, url) == STEP
    assert "illegal" not in caplog.text and "catalog record" not in caplog.text, caplog.text

    ((cp, replicas, files),) = _rows(url)
    assert cp.state == CheckpointState.VERIFIED  # writing -> committed -> verified
    assert cp.manifest_checksum == checksum_bytes((directory / MANIFEST_NAME).read_bytes())
    assert (cp.bytes, cp.file_count) == (manifest.total_bytes, len(manifest.files))
    assert sorted(f.path for f in files) == sorted(f.path for f in manifest.files)
    assert [(r.tier, r.state, r.uri) for r in replicas] == [("hot", ReplicaState.READY, str(directory))]
    catalog = Catalog.open(url)
    try:
        (event,) = catalog.undelivered_events()  # reconcile emits it: the checkpoint gets promoted
        kinds = [e.kind for e in catalog.events(RUN)]
    finally:
        catalog.dispose()
    assert (event.run, event.step, event.payload["hot_uri"]) == (RUN, STEP, str(directory))
    assert "checkpoint.committed" in kinds and "checkpoint.verified" in kinds

    assert _restore_here(hot, url) == STEP  # a second restore changes nothing
    ((again, _, _),) = _rows(url)
    assert again.state == CheckpointState.VERIFIED and again.updated_at == cp.updated_at


@pytest.mark.parametrize("moment", ["manifest", "write"])
def test_an_attempt_killed_mid_write_is_abandoned_when_its_partial_is_removed(
    tmp_path: Path, moment: str
) -> None:
    hot, url = tmp_path / "hot", f"sqlite:///{tmp_path / 'catalog.db'}"
    _finish(_launch(1, str(hot), url, tmp_path, "--kill-at", moment), tmp_path, -signal.SIGKILL)
    (partial,) = [e.path for e in layout.scan(hot / RUN) if e.kind == "partial"]
    ((cp, _, _),) = _rows(url)
    assert cp.state == CheckpointState.WRITING and partial.name == layout.partial_name(STEP, cp.save_id)

    assert _restore_here(hot, url, stale_age=0) == 0
    assert not partial.exists()
    ((cp, _, _),) = _rows(url)
    assert cp.state == CheckpointState.ABANDONED  # was left "writing" for good
    assert partial.name in (cp.reason or "")


def test_on_two_nodes_rank_0_records_what_node_1_removed(tmp_path: Path) -> None:
    roots, url = str(tmp_path / "node{rank}"), f"sqlite:///{tmp_path / 'catalog.db'}"
    _finish(_launch(2, roots, url, tmp_path, "--kill-at", "write"), tmp_path, -signal.SIGKILL)
    partials = {
        node: [e.path for e in layout.scan(tmp_path / f"node{node}" / RUN) if e.kind == "partial"]
        for node in (0, 1)
    }
    assert [len(p) for p in partials.values()] == [1, 1], partials
    ((cp, _, _),) = _rows(url)
    assert cp.state == CheckpointState.WRITING
    # Node 0's directory looks as if its writer had only just started (kept); node 1's is an hour
    # old (removed): only node 1's leader removes anything, and only rank 0 writes the catalog.
    now = time.time()
    os.utime(partials[0][0], (now, now))
    os.utime(partials[1][0], (now - 3600, now - 3600))

    out = tmp_path / "restored.json"
    procs = _launch(2, roots, url, tmp_path, "--stale-age", "600", "--out", str(out))
    _finish(procs, tmp_path, 0)
    assert json.loads(out.read_text()) == {"step": 0}
    assert partials[0][0].exists() and not partials[1][0].exists()
    ((cp, _, _),) = _rows(url)
    assert cp.state == CheckpointState.ABANDONED
    assert partials[1][0].name in (cp.reason or "") and "node 1" in (cp.reason or "")
