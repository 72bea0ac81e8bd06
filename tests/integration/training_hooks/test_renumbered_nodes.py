"""A sharded (FSDP2) job whose nodes come back renumbered resumes from its newest checkpoint.

torchrun's c10d rendezvous numbers nodes by host name; after a requeue, or with a replacement host
whose name sorts first, the same disks come back under other node ranks. Two simulated nodes (mount
namespaces, each with its own disk at one hot path and its own host name), 2 ranks each, a peer
server per node (``python -m ckptflow.peer``, which announces its address in the node's hot root).
The test is the operator and alone looks at every node's disk. The launches, once for the module:

1. reference: train 12 steps uninterrupted.
2. first: train to step 10, saving steps 5 and 10; nothing on warm.
3. swapped: the same hosts and disks with their node ranks swapped (host node1 is now node 0), and
   the catalog down (an address nothing listens on), and node1's step 10 never decided on its disk
   (the node died after committing its part, before writing the decision): restore must take step
   10, node1 getting the decision written back, each node fetching the part its new ranks read from
   the other node's own disk through its peer server, set nothing aside, and train on to 12
   bit-identical to the reference. Before parts were found by shard
   identity, this restore called step 10 unreachable, quarantined it on both nodes and, with nothing
   on warm, started from step 0.
4. replacement: a new host that sorts first (``a-new``, an empty disk) takes node rank 0, old host
   node0 (its disk holding part 0) is node 1, and node1's disk is gone; warm holds step 10. Restore
   takes step 10: part 0 from node0's own disk through its peer server, part 1 from warm.
5. replicas: two fresh disks, each with its own step 5 and, of step 10, only the other node's part as
   a peer replica; nothing on warm. Step 10 survives only in replicas: restore takes it (its
   decision from a replica), each node fetching its part from the replica the other node holds.
   Before replicas counted as a record of the decision, this restore started from step 5.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptflow.peer import PartId, replica_dir
from ckptflow.peer.identity import replica_entries
from ckptflow.services import simulated_nodes
from ckptflow.services.simulated_nodes import Cluster, cluster
from ckptflow.storage import layout
from ckptflow.storage.layout import METADATA_NAME
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(simulated_nodes.unavailable() is not None, reason=str(simulated_nodes.unavailable())),
]

WORKER = Path(__file__).resolve().parents[1] / "renumber_worker.py"
RUN = "main"
TIMEOUT_S = 300.0
DEAD_CATALOG = "postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=2"


@dataclass
class Launches:
    disks: dict[str, Path]
    out: dict[str, Path]
    warm: Path

    def results(self, launch: str) -> list[dict[str, Any]]:
        return [json.loads((self.out[launch] / f"rank{r}.json").read_text()) for r in range(4)]


def _config(path: Path, hot: Path, catalog: str, secret: Path, warm: Path | None = None) -> Path:
    tiers: dict[str, Any] = {"hot": {"kind": "posix", "root": str(hot)}}
    if warm is not None:
        tiers["warm"] = {"kind": "posix", "root": str(warm)}
    body = {
        "catalog": catalog,
        "tiers": tiers,
        "checkpoint": {"deadline_s": 120, "store": "auto"},
        "replication": {"secret_file": str(secret), "timeout_s": 20, "retries": 1},
    }
    path.write_text(yaml.safe_dump(body))
    return path


def _run(job: Cluster, config: Path, out: Path, extra: list[str], peers: bool, hot: Path) -> None:
    """Boot the job's nodes, start a peer server in each (when asked), train, and end the nodes."""
    job.boot()
    if peers:
        for node in job.nodes:
            argv = [sys.executable, "-m", "ckptflow.peer", "--hot-root", str(hot), "--config", str(config)]
            argv += ["--host", f"127.0.1.{node.index + 1}", "--port", "0"]
            node.spawn(argv, node.log)  # ended with the node
        deadline = time.monotonic() + 60
        while not all("ckptflow-peer listening on" in n.output() for n in job.nodes):
            if time.monotonic() > deadline:
                job.kill()
                pytest.fail(f"peer servers did not start\n{job.output()}")
            time.sleep(0.2)
    try:
        job.start(WORKER, ["--config", str(config), "--out", str(out), *extra])
        job.wait(TIMEOUT_S)
    finally:
        job.shutdown()


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launches]:
    work = tmp_path_factory.mktemp("renumber")
    hot, warm = work / "hot", work / "warm"
    secret = work / "secret"
    secret.write_text("renumbered-nodes-test-secret-0123456789")
    os.chmod(secret, 0o600)
    catalog = f"sqlite:///{work / 'catalog.db'}"
    disks = {
        name: work / f"disk-{name}" for name in ("ref0", "ref1", "node0", "node1", "new", "rep0", "rep1")
    }
    out = {
        name: work / f"out-{name}" for name in ("reference", "first", "swapped", "replacement", "replicas")
    }
    plain = _config(work / "plain.yaml", hot, catalog, secret)

    reference = cluster("reference", work, hot, [disks["ref0"], disks["ref1"]], nproc=2)
    _run(reference, plain, out["reference"], ["--steps", "12"], peers=False, hot=hot)
    first = cluster("first", work, hot, [disks["node0"], disks["node1"]], nproc=2)
    _run(first, plain, out["first"], ["--save-at", "5,10", "--stop-at", "10"], peers=False, hot=hot)
    # The operator keeps a copy of step 10 on warm for the replacement launch, from both disks.
    kept = work / "kept"
    for name in ("node0", "node1"):
        shutil.copytree(disks[name], kept / name)

    # Node1 died between committing its part and writing the decision: its step-10 holds the part
    # (PART.json) and no manifest or .metadata, while node0's holds the decision.
    for name in (MANIFEST_NAME, METADATA_NAME):
        (disks["node1"] / RUN / "step-10" / name).unlink()
    dead = _config(work / "dead.yaml", hot, DEAD_CATALOG, secret)
    swapped = cluster(
        "swapped", work, hot, [disks["node1"], disks["node0"]], nproc=2, hosts=["node1", "node0"]
    )
    _run(swapped, dead, out["swapped"], ["--steps", "12"], peers=True, hot=hot)

    for name in ("node0", "node1"):  # warm: step 10 whole; node0's disk as it was; node1's gone
        shutil.copytree(kept / name / RUN / "step-10", warm / RUN / "step-10", dirs_exist_ok=True)
    shutil.rmtree(disks["node0"])
    shutil.copytree(kept / "node0", disks["node0"])
    with_warm = _config(work / "warm.yaml", hot, catalog, secret, warm)
    replacement = cluster(
        "replacement", work, hot, [disks["new"], disks["node0"]], nproc=2, hosts=["a-new", "node0"]
    )
    _run(replacement, with_warm, out["replacement"], ["--steps", "12"], peers=True, hot=hot)

    # Replicas only: each disk keeps its own step 5 and, of step 10, only the other node's part as a
    # peer replica (what a replica holds: that part's files, .metadata, the manifest).
    for k, (name, other) in enumerate((("rep0", "node1"), ("rep1", "node0"))):
        step10 = kept / other / RUN / "step-10"
        manifest = read_manifest(step10)
        replica = replica_dir(disks[name], RUN, 10, PartId(1 - k, 2))
        replica.mkdir(parents=True)
        for entry in replica_entries(manifest, 1 - k):
            shutil.copy2(step10 / entry.path, replica / entry.path)
        shutil.copy2(step10 / MANIFEST_NAME, replica / MANIFEST_NAME)
        shutil.copytree(kept / f"node{k}" / RUN / "step-5", disks[name] / RUN / "step-5")
    replicas = cluster("replicas", work, hot, [disks["rep0"], disks["rep1"]], nproc=2)
    _run(replicas, plain, out["replicas"], ["--steps", "12"], peers=True, hot=hot)
    yield Launches(disks, out, warm)


def _fetched(node_ranks: list[dict[str, Any]]) -> dict[str, int]:
    """Bytes a node's ranks fetched, by source (each rank fetched its share of the node's files)."""
    total: dict[str, int] = {}
    for result in node_ranks:
        for source, size in result["fetched_by_source"].items():
            total[source] = total.get(source, 0) + size
    return total


def _quarantined(disk: Path) -> list[str]:
    base = disk / RUN / layout.QUARANTINE_DIR
    return sorted(p.name for p in base.iterdir()) if base.is_dir() else []


def test_swapped_node_ranks_resume_from_the_newest_step_bit_identical(launches: Launches) -> None:
    reference, swapped = launches.results("reference"), launches.results("swapped")
    assert [r["start"] for r in swapped] == [10, 10, 10, 10], [r["rejected"] for r in swapped]
    assert [r["host"] for r in swapped] == ["node1", "node1", "node0", "node0"]
    for got, ref in zip(swapped, reference, strict=True):
        assert got["params"] == ref["params"] and got["exp_avg_sq"] == ref["exp_avg_sq"]
        assert {int(k): v for k, v in got["losses"].items()} == {
            int(k): v for k, v in ref["losses"].items() if int(k) >= 10
        }
    # Each node fetched what its new ranks read from the other node's own disk, and nothing else.
    sources = {s for r in swapped for s in r["fetched_by_source"]}
    assert sources == {"peer node0", "peer node1"}, [r["fetched_by_source"] for r in swapped]
    # "Not reachable through the catalog" set nothing aside: no quarantine on either disk.
    assert _quarantined(launches.disks["node0"]) == [] and _quarantined(launches.disks["node1"]) == []
    for name in ("node0", "node1"):
        assert read_manifest(launches.disks[name] / RUN / "step-10").step == 10


def test_a_replacement_host_that_sorts_first_gets_part_0_from_a_peer_and_part_1_from_warm(
    launches: Launches,
) -> None:
    reference, replaced = launches.results("reference"), launches.results("replacement")
    assert [r["start"] for r in replaced] == [10, 10, 10, 10], [r["rejected"] for r in replaced]
    assert [r["host"] for r in replaced] == ["a-new", "a-new", "node0", "node0"]
    for got, ref in zip(replaced, reference, strict=True):
        assert got["params"] == ref["params"] and got["exp_avg_sq"] == ref["exp_avg_sq"]
    manifest = read_manifest(launches.warm / RUN / "step-10")
    new_node, old_node = _fetched(replaced[:2]), _fetched(replaced[2:])
    assert set(new_node) == {"peer node0"} and sum(new_node.values()) > 0  # part 0, from node0's own disk
    assert set(old_node) == {"warm"} and sum(old_node.values()) == manifest.part_bytes(1)
    assert _quarantined(launches.disks["node0"]) == []
    # Written back: the new host holds what its ranks read; node0 holds its own part and part 1.
    assert (launches.disks["new"] / RUN / "step-10").is_dir()


def test_a_checkpoint_that_survives_only_in_peer_replicas_is_restored(launches: Launches) -> None:
    reference, restored = launches.results("reference"), launches.results("replicas")
    assert [r["start"] for r in restored] == [10, 10, 10, 10], [r["rejected"] for r in restored]
    for got, ref in zip(restored, reference, strict=True):
        assert got["params"] == ref["params"] and got["exp_avg_sq"] == ref["exp_avg_sq"]
    assert set(_fetched(restored[:2])) == {"peer node1"} and set(_fetched(restored[2:])) == {"peer node0"}
    for name in ("rep0", "rep1"):  # each node holds its part again, decided
        assert read_manifest(launches.disks[name] / RUN / "step-10").step == 10
