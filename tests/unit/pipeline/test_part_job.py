"""A node's share of promotion without Prefect (:func:`ckptflow.pipeline.part_job.promote_node_part`):
real POSIX hot and warm tiers, a real catalog, and recording fake steps in place of the flow's tasks
(the flow's own steps run in tests/integration/pipeline/test_promote_part_race.py and the other promote-part
tests). Two nodes saved step 7; this node is host-a, holding node 0's part."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ckptflow.catalog import Catalog, LeaseGrant, ReplicaState
from ckptflow.pipeline.part import part_lease
from ckptflow.pipeline.part_job import (
    CopiedBatches,
    PartJob,
    PartPromotionError,
    PartSteps,
    promote_node_part,
)
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, NodePart
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.tier import TierError

RUN, STEP, HOST = "r", 7, "host-a"
PART_0 = ["__0_0.distcp", "__1_0.distcp"]  # node 0's part (ranks 0 and 1), what host-a holds
PART_1 = ["__2_0.distcp", "__3_0.distcp"]  # node 1's part, on host-b only


@dataclass
class World:
    catalog_url: str
    hot: PosixTier  # host-a's disk
    warm: PosixTier
    whole: Path  # every file of the step, as both nodes together hold it
    manifest: Manifest

    def job(self) -> PartJob:
        return PartJob(RUN, STEP, HOST, self.warm, self.hot, self.catalog_url)

    def other_node_copies_its_part(self) -> None:
        """host-b's run copied node 1's part into warm's incoming copy (not published)."""
        self.warm.put_files(self.whole, self.manifest, PART_1)

    def replica(self) -> Any:
        catalog = Catalog.open(self.catalog_url)
        try:
            (checkpoint,) = [c for c in catalog.checkpoints(RUN) if c.step == STEP]
            return {r.tier: r for r in catalog.replicas(checkpoint.id)}.get("warm")  # type: ignore[arg-type]
        finally:
            catalog.dispose()


@pytest.fixture
def world(tmp_path: Path, catalog_url: str) -> World:
    whole = tmp_path / "whole"
    whole.mkdir()
    entries = []
    for rank, name in enumerate(PART_0 + PART_1):
        data = bytes([rank + 1]) * (1000 + rank)
        (whole / name).write_bytes(data)
        entries.append(FileEntry(name, len(data), checksums.checksum_bytes(data), rank, rank // 2))
    nodes = (NodePart(0, "host-a", (0, 1)), NodePart(1, "host-b", (2, 3)))
    manifest = Manifest(RUN, STEP, 4, "s", tuple(entries), nodes=nodes)
    (whole / MANIFEST_NAME).write_bytes(manifest.to_json())
    hot = PosixTier("hot", tmp_path / "hot")
    mine = hot.path(RUN, STEP)
    mine.mkdir(parents=True)
    for name in [*PART_0, MANIFEST_NAME]:
        (mine / name).write_bytes((whole / name).read_bytes())
    return World(catalog_url, hot, PosixTier("warm", tmp_path / "warm"), whole, manifest)


@dataclass
class Recorder:
    """The flow's steps, done in place on the tiers, each call recorded in order."""

    world: World
    asked: list[str] = field(default_factory=list)  # the hosts ask_for_catch_up says it asked
    failing: TierError | None = None  # every batch fails with it
    after_copy: Any = None  # called when the copy ends (what another node does meanwhile)
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def steps(self) -> PartSteps:
        source = self.world.hot.path(RUN, STEP)

        @contextmanager
        def copy(
            run: str, step: int, tier: str, manifest: Manifest, paths: list[str]
        ) -> Iterator[CopiedBatches]:
            self.calls.append(("copy", run, step, tier, sorted(paths)))
            done = CopiedBatches()
            yield done
            if self.failing is not None:
                done.failed.append(self.failing)
            else:
                result = self.world.warm.put_files(source, manifest, paths)
                done.copied.append({"files": result.files, "bytes": result.bytes, "seconds": result.seconds})
            if self.after_copy is not None:
                self.after_copy()

        def commit(run: str, step: int, tier: str) -> str:
            self.calls.append(("commit", run, step, tier))
            return self.world.warm.commit(source, self.world.manifest, files_checked=True).uri

        def announce(run: str, step: int, tier: str, host: str) -> None:
            self.calls.append(("announce", run, step, tier, host))

        def ask_for_catch_up(
            manifest: Manifest, lacking: list[str], after_s: float, host: str, catalog: Catalog, tier: str
        ) -> list[str]:
            self.calls.append(("catch up", sorted(lacking), after_s, host, tier))
            return self.asked

        return PartSteps(copy=copy, commit=commit, announce=announce, ask_for_catch_up=ask_for_catch_up)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def test_the_node_that_completes_the_tier_publishes_it_and_announces_it(world: World) -> None:
    world.other_node_copies_its_part()
    recorder = Recorder(world)
    row = promote_node_part(world.job(), recorder.steps())
    assert row["action"] == "published", row
    assert recorder.calls == [
        ("copy", RUN, STEP, "warm", PART_0),
        ("commit", RUN, STEP, "warm"),
        ("announce", RUN, STEP, "warm", HOST),
    ]
    assert (row["run"], row["step"], row["node"], row["tier"]) == (RUN, STEP, HOST, "warm")
    assert row["files"] == 2 and row["parts_held"] == [0] and row["uri"] == world.warm.uri(RUN, STEP)
    assert set(row["data_phases"]) == {"copy", "commit"}
    published = world.warm.path(RUN, STEP)
    assert sorted(p.name for p in published.iterdir()) == sorted([*PART_0, *PART_1, MANIFEST_NAME])


def test_a_part_whose_lease_another_node_holds_is_left_to_it_and_not_copied(world: World) -> None:
    catalog = Catalog.open(world.catalog_url)
    try:
        got = catalog.acquire_lease(
            RUN,
            STEP,
            "warm",
            part_lease(0),
            holder="promote-part on host-c",
            purpose="promote-part",
            ttl_s=60,
        )
        assert isinstance(got, LeaseGrant)
    finally:
        catalog.dispose()
    recorder = Recorder(world)
    row = promote_node_part(world.job(), recorder.steps())
    assert row["action"] == "in progress elsewhere", row
    assert row["holders"] == ["promote-part on host-c"] and "host-c" in row["detail"]
    assert recorder.calls == []  # nothing copied, nothing published
    assert sorted(world.warm.missing_files(world.manifest)) == sorted(PART_0 + PART_1)


def test_a_node_whose_tier_still_lacks_other_parts_names_them_and_asks_for_catch_up(world: World) -> None:
    recorder = Recorder(world, asked=["host-b"])
    row = promote_node_part(world.job(), recorder.steps())
    assert row["action"] == "part copied", row
    assert row["waiting_for"] == ["node 1 (host-b)"] and row["catch_up"] == ["host-b"]
    assert recorder.calls == [
        ("copy", RUN, STEP, "warm", PART_0),
        ("catch up", PART_1, 60.0, HOST, "warm"),  # promote.catch_up_after_s's default
    ]
    replica = world.replica()
    assert replica.state == ReplicaState.COPYING
    assert replica.reason == "waiting for the parts of node 1 (host-b)"


def test_nobody_asked_to_catch_up_leaves_no_catch_up_in_the_row(world: World) -> None:
    row = promote_node_part(world.job(), Recorder(world).steps())
    assert row["action"] == "part copied" and "catch_up" not in row, row


def test_a_step_the_last_node_published_during_this_copy_is_reported_published(world: World) -> None:
    def the_other_node_publishes() -> None:
        world.warm.put(world.whole, world.manifest)

    recorder = Recorder(world, after_copy=the_other_node_publishes)
    row = promote_node_part(world.job(), recorder.steps())
    assert row["action"] == "already published", row
    assert recorder.names() == ["copy"]  # neither waiting (nor asking) nor publishing again
    assert "waiting_for" not in row and row["files"] == 2


def test_a_batch_that_fails_fails_the_run_naming_the_node_and_nothing_is_published(world: World) -> None:
    world.other_node_copies_its_part()
    recorder = Recorder(world, failing=TierError("warm: __1_0.distcp does not match its manifest"))
    with pytest.raises(PartPromotionError) as raised:
        promote_node_part(world.job(), recorder.steps())
    assert str(raised.value) == (
        "node host-a: its part of r step 7 could not be copied to warm: "
        "warm: __1_0.distcp does not match its manifest"
    )
    assert recorder.names() == ["copy"]
    assert world.warm.read_manifest(RUN, STEP) is None


def test_a_published_step_or_one_this_node_lacks_copies_nothing(world: World, tmp_path: Path) -> None:
    recorder = Recorder(world)
    elsewhere = PartJob(RUN, STEP + 1, HOST, world.warm, world.hot, world.catalog_url)
    assert promote_node_part(elsewhere, recorder.steps())["action"] == "nothing on this node"
    world.warm.put(world.whole, world.manifest)
    assert promote_node_part(world.job(), recorder.steps())["action"] == "already published"
    assert recorder.calls == []
