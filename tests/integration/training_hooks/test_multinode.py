"""Multi-node training on node-local disks, with real processes: nodes are mount namespaces.

Each simulated node (simulated_nodes.py) has its own disk at the same hot-root path, runs torchrun
with a c10d rendezvous on 127.0.0.1, and can be killed as a whole. ``warm`` is a directory shared
by all nodes (the parallel filesystem). The launches, run once for the module:

1. reference: 2 nodes x 2 ranks train 12 steps uninterrupted.
2. crash: the same job, its parts of steps 3 and 6 copied to warm by each node; node 1 is killed
   (SIGKILL, every process of the node) in the middle of its write of step 9, node 0 right after,
   and node 1's disk is emptied (a replacement node).
3. resume: the same job restarts on the replacement; it must resume at step 6, node 1 fetching only
   its own part from warm and node 0 nothing, and end bit-identical to the reference. Then, in the
   same job: a node held past the deadline (ABANDONED), a flipped bit on one node (walk back), a
   byte changed between planning and loading (caught by the load's own read).
4. restore on 3 nodes x 2 ranks (a new, empty third disk) and on 1 node of 1 rank.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptflow.services import simulated_nodes
from ckptflow.services.simulated_nodes import Cluster, cluster
from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(simulated_nodes.unavailable() is not None, reason=str(simulated_nodes.unavailable())),
]

WORKER = Path(__file__).resolve().parents[1] / "multinode_worker.py"
LAUNCH_TIMEOUT_S = 240.0


@dataclass
class Runs:
    work: Path
    hot: Path
    warm: Path
    disks: list[Path]
    out: dict[str, Path]
    logs: dict[str, str]
    kill_seen: list[str]

    def result(self, launch: str, scenario: str, rank: int) -> dict[str, Any]:
        return json.loads((self.out[launch] / scenario / f"rank{rank}.json").read_text())

    def log(self, launch: str, scenario: str, rank: int) -> str:
        return (self.out[launch] / scenario / f"rank{rank}.log").read_text()

    def step_dir(self, node: int, step: int, run: str = "main") -> Path:
        return self.disks[node] / run / layout.committed_name(step)


def _launch(job: Cluster, out: Path, runs_args: list[str], scenarios: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    job.start(WORKER, ["--out", str(out), "--scenarios", scenarios, *runs_args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    work = tmp_path_factory.mktemp("multinode")
    hot, warm = work / "hot", work / "warm"
    disks = [work / f"disk{k}" for k in range(3)]
    ref_disks = [work / f"ref-disk{k}" for k in range(2)]
    out = {name: work / f"out-{name}" for name in ("reference", "crash", "resume", "three", "one")}
    common = ["--hot", str(hot), "--warm", str(warm)]
    logs: dict[str, str] = {}
    kill_seen: list[str] = []

    reference = cluster("reference", work, hot, ref_disks, nproc=2)
    _launch(reference, out["reference"], [*common[:2], "--warm", str(work / "ref-warm")], "train")
    reference.wait(LAUNCH_TIMEOUT_S)
    reference.shutdown()
    logs["reference"] = reference.output()

    crash = cluster("crash", work, hot, disks[:2], nproc=2)
    _launch(
        crash, out["crash"], [*common, "--promote", "3,6", "--slow-node", "1", "--slow-step", "9"], "train"
    )
    markers = [out["crash"] / f"slow-rank{r}" for r in (2, 3)]
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not all(m.exists() for m in markers):
        if time.monotonic() > deadline or any(p.poll() is not None for p in crash.launchers):
            crash.kill()
            pytest.fail(f"node 1 never reached its write of step 9\n{crash.output()}")
        time.sleep(0.1)
    kill_seen.extend(sorted(p.name for p in disks[1].rglob("*")))
    crash.nodes[1].kill()  # the node dies in the middle of its background write
    crash.nodes[0].kill()  # and the job with it
    logs["crash"] = crash.output()
    shutil.rmtree(disks[1])  # a replacement node: an empty disk
    disks[1].mkdir()

    resume = cluster("resume", work, hot, disks[:2], nproc=2)
    _launch(resume, out["resume"], [*common, "--promote", "12"], "train,straggler,corrupt,inject")
    resume.wait(LAUNCH_TIMEOUT_S)
    resume.shutdown()
    logs["resume"] = resume.output()

    three = cluster("three", work, hot, disks, nproc=2)
    _launch(three, out["three"], common, "restore-only")
    three.wait(LAUNCH_TIMEOUT_S)
    three.shutdown()
    one = cluster("one", work, hot, disks[:1], nproc=1)
    _launch(one, out["one"], common, "restore-only")
    one.wait(LAUNCH_TIMEOUT_S)
    one.shutdown()
    yield Runs(work, hot, warm, disks, out, logs, kill_seen)


# --- commit on two nodes -------------------------------------------------------------------------


def test_every_save_commits_and_each_node_holds_only_its_own_part(runs: Runs) -> None:
    saves = runs.result("reference", "train", 0)["saves"]
    assert [(s["step"], s["outcome"]) for s in saves] == [
        (3, "committed"),
        (6, "committed"),
        (9, "committed"),
        (12, "committed"),
    ]
    for node, own in ((0, {"__0_0.distcp", "__1_0.distcp"}), (1, {"__2_0.distcp", "__3_0.distcp"})):
        directory = runs.work / f"ref-disk{node}" / "main" / layout.committed_name(12)
        names = {p.name for p in directory.iterdir()}
        assert names == own | {".metadata", MANIFEST_NAME, "PART.json"}, (node, names)
        manifest = read_manifest(directory)
        assert [n.host for n in manifest.nodes] == ["node0", "node1"]
        # .metadata is written by the coordinator (node 0's part) and every node holds a copy.
        expected = own | ({".metadata"} if node == 0 else set())
        assert {f.path for f in manifest.part_files(node)} == expected
    # The warm copy was never written by the reference run; nothing else is on a disk.
    assert not (runs.work / "ref-warm").exists()


def test_the_hot_path_outside_the_nodes_stays_empty(runs: Runs) -> None:
    # Every node wrote to its own disk through the same path; the path itself holds nothing.
    assert list(runs.hot.iterdir()) == []


# --- node replacement ----------------------------------------------------------------------------


def test_the_killed_node_was_writing_step_9(runs: Runs) -> None:
    assert any(name.startswith("step-9.partial-") for name in runs.kill_seen), runs.kill_seen
    # Steps 3 and 6 (and later 12) reached warm, each published once both nodes' parts had arrived.
    assert sorted(layout.committed_steps(runs.warm / "main")) == [3, 6, 12]


def test_the_replacement_node_fetches_only_its_own_part_and_resumes_at_the_newest_complete_step(
    runs: Runs,
) -> None:
    results = [runs.result("resume", "train", r) for r in range(4)]
    assert [r["start"] for r in results] == [6, 6, 6, 6]
    manifest = read_manifest(runs.warm / "main" / layout.committed_name(6))
    fetched = {
        node: sum(r["restore"]["fetched_bytes"] for r in results if r["restore"]["node"] == node)
        for node in (0, 1)
    }
    assert fetched == {0: 0, 1: manifest.part_bytes(1)}, fetched
    assert all(r["restore"]["rejected"] == [] for r in results)
    # The replacement node holds its part of step 6 again, with the decision (manifest) beside it.
    names = {p.name for p in runs.step_dir(1, 6).iterdir()}
    assert names == {"__2_0.distcp", "__3_0.distcp", ".metadata", MANIFEST_NAME}
    assert (runs.step_dir(1, 6) / MANIFEST_NAME).read_bytes() == (
        runs.warm / "main" / "step-6" / MANIFEST_NAME
    ).read_bytes()
    # Node 0's part of step 9 was never decided (node 1 died first): gone from its disk.
    assert [p.name for p in (runs.disks[0] / "main").iterdir() if p.name.startswith("step-9.")] == []


def test_the_resumed_run_ends_bit_identical_to_the_uninterrupted_one(runs: Runs) -> None:
    for rank in range(4):
        reference = runs.result("reference", "train", rank)["final"]
        resumed = runs.result("resume", "train", rank)["final"]
        assert resumed == reference, f"rank {rank} differs"


# --- other world sizes ---------------------------------------------------------------------------


def test_restore_on_three_nodes_reshards_from_disks_and_warm(runs: Runs) -> None:
    saved = runs.result("resume", "train", 0)["final"]
    results = [runs.result("three", "restore-only", r) for r in range(6)]
    for rank, result in enumerate(results):
        assert result["restore"]["step"] == 12, rank
        assert result["restore"]["nodes"] == 3
        assert result["final"]["table"] == saved["table"]
        assert result["final"]["mlp_and_adam"] == saved["mlp_and_adam"]
        assert result["final"]["history"] == saved["history"]
    assert [r["local_rows"] for r in results] == [2] * 6
    # The new third node had nothing and fetched what its ranks read; node 0 read only its own disk.
    by_node = {
        n: sum(r["restore"]["fetched_bytes"] for r in results if r["restore"]["node"] == n) for n in range(3)
    }
    assert by_node[0] == 0 and by_node[2] > 0, by_node


def test_restore_on_one_node_and_one_rank(runs: Runs) -> None:
    saved = runs.result("resume", "train", 0)["final"]
    result = runs.result("one", "restore-only", 0)
    assert result["restore"]["step"] == 12
    assert result["local_rows"] == 12
    assert result["final"]["table"] == saved["table"]
    assert result["final"]["mlp_and_adam"] == saved["mlp_and_adam"]


# --- a node past the deadline --------------------------------------------------------------------


def test_a_node_held_past_the_deadline_abandons_that_checkpoint_and_training_goes_on(runs: Runs) -> None:
    saves = runs.result("resume", "straggler", 0)["saves"]
    assert saves[0] == {"step": 4, "outcome": "abandoned", "missing_nodes": [1], "missing_ranks": [2, 3]}
    assert "checkpoint step 4 ABANDONED: node 1 (node1, ranks [2, 3]) missed the 2 s deadline" in runs.log(
        "resume", "straggler", 0
    )
    later = [s["step"] for s in saves[1:] if s["outcome"] == "committed"]
    assert later, saves
    for rank in range(4):
        result = runs.result("resume", "straggler", rank)
        assert max(result["step_s"]) < 3.0, (rank, result["step_s"])  # nobody waited for node 1
    # No node kept anything of the abandoned attempt (removed during the run).
    for node in (0, 1):
        names = sorted(p.name for p in (runs.disks[node] / "straggler").iterdir())
        assert all(layout.parse_committed(n) is not None or n == layout.QUARANTINE_DIR for n in names), names
        assert layout.committed_name(4) not in names


# --- corruption ----------------------------------------------------------------------------------


def test_a_corrupt_file_on_one_node_walks_every_rank_back_and_quarantines_only_that_part(runs: Runs) -> None:
    results = [runs.result("resume", "corrupt", r) for r in range(4)]
    newest = results[0]["newest"]
    steps = {r["restore"]["step"] for r in results}
    assert len(steps) == 1 and steps.pop() < newest
    assert all(newest in [s for s, _ in r["restore"]["rejected"]] for r in results)
    quarantined = list((runs.disks[0] / "straggler" / layout.QUARANTINE_DIR).glob(f"step-{newest}.*"))
    assert len(quarantined) == 1
    assert "__1_0.distcp" in (quarantined[0] / "QUARANTINE_REASON.txt").read_text()
    assert "checksum" in (quarantined[0] / "QUARANTINE_REASON.txt").read_text()
    # Node 1's part of the same step is intact and stays where it is.
    assert (runs.step_dir(1, newest, "straggler") / MANIFEST_NAME).is_file()
    assert not (runs.disks[1] / "straggler" / layout.QUARANTINE_DIR).exists()


def test_a_byte_changed_after_planning_and_before_loading_is_caught_by_the_load(runs: Runs) -> None:
    results = [runs.result("resume", "inject", r) for r in range(4)]
    assert results[3]["flipped"], "the fault was not injected"
    assert [r["restore"]["step"] for r in results] == [2, 2, 2, 2]
    assert all([s for s, _ in r["restore"]["rejected"]][:1] == [4] for r in results)
    assert list((runs.disks[1] / "inject" / layout.QUARANTINE_DIR).glob("step-4.*"))
    assert (runs.step_dir(0, 4, "inject") / MANIFEST_NAME).is_file()
