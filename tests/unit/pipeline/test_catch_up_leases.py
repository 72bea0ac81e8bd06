"""Before asking Prefect about a node it waits for, a node reads the part leases in the catalog: a
part someone is copying now (its lease is live) is not lost, so it is neither looked up nor asked
for (on SQLite and PostgreSQL; the Prefect side: tests/integration/pipeline/test_part_catch_up.py)."""

from __future__ import annotations

import time

import pytest

from ckptflow.catalog import Catalog, LeaseGrant
from ckptflow.pipeline.part import node_of_part_lease, part_lease
from ckptflow.pipeline.part_catch_up import parts_being_copied, waited_nodes
from ckptflow.storage.manifest import FileEntry, Manifest, NodePart
from ckptflow.tasks.catch_up import ask_for_catch_up


def _manifest(nodes: int = 3) -> Manifest:
    return Manifest(
        run="r",
        step=7,
        world_size=nodes,
        save_id="s",
        files=tuple(FileEntry(f"__{k}_0.distcp", 10, "0" * 16, rank=k, node=k) for k in range(nodes)),
        nodes=tuple(NodePart(k, f"host-{k}", (k,)) for k in range(nodes)),
    )


def _lease(catalog: Catalog, part: str, ttl_s: float, tier: str = "warm") -> None:
    got = catalog.acquire_lease("r", 7, tier, part, holder="a copier", purpose="promote-part", ttl_s=ttl_s)
    assert isinstance(got, LeaseGrant)


def test_a_part_lease_names_its_node_and_nothing_else_does() -> None:
    assert [node_of_part_lease(part_lease(k)) for k in (0, 7, 123)] == [0, 7, 123]
    assert node_of_part_lease("all") is None
    assert node_of_part_lease("part-") is None and node_of_part_lease("part-x") is None
    assert node_of_part_lease("host-a") is None
    assert node_of_part_lease("part-\u00b2") is None  # a digit to str.isdigit, not to int()
    assert node_of_part_lease("part-\u0663") is None  # an Arabic-Indic 3: not a lease this writes


def test_only_live_part_leases_of_that_step_and_tier_count_as_being_copied(catalog: Catalog) -> None:
    _lease(catalog, part_lease(1), ttl_s=60)  # node 1's part: someone copies it now
    _lease(catalog, part_lease(2), ttl_s=0.2)  # node 2's copier died: its lease runs out
    _lease(catalog, "all", ttl_s=60)  # a publisher: no part
    _lease(catalog, part_lease(0), ttl_s=60, tier="cold")  # another tier
    time.sleep(0.4)
    assert parts_being_copied(catalog, "r", 7, "warm") == {1}
    assert parts_being_copied(catalog, "r", 8, "warm") == set()


def test_nodes_being_copied_are_not_asked_about_and_prefect_is_not_called(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    import prefect

    def no_prefect(*args: object, **kwargs: object) -> None:
        raise AssertionError("Prefect was asked although every waited-for part is being copied")

    manifest = _manifest()
    lacking = ["__1_0.distcp", "__2_0.distcp"]
    assert waited_nodes(manifest, lacking, "host-0") == [(1, "host-1"), (2, "host-2")]
    _lease(catalog, part_lease(1), ttl_s=60)
    _lease(catalog, part_lease(2), ttl_s=60)
    monkeypatch.setattr(prefect, "get_client", no_prefect)
    assert ask_for_catch_up(manifest, lacking, 30.0, "host-0", catalog, "warm") == []


def test_a_catalog_that_cannot_be_read_leaves_the_question_to_prefect(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    import prefect

    def unreadable(*args: object, **kwargs: object) -> None:
        raise OSError("database is locked")

    asked: list[str] = []

    class NoRuns:
        def __enter__(self) -> NoRuns:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def read_deployment_by_name(self, name: str) -> None:
            asked.append(name)
            raise LookupError("no such deployment")

    _lease(catalog, part_lease(1), ttl_s=60)
    monkeypatch.setattr(catalog, "leases", unreadable)
    monkeypatch.setattr(prefect, "get_client", lambda **kwargs: NoRuns())
    assert ask_for_catch_up(_manifest(2), ["__1_0.distcp"], 30.0, "host-0", catalog, "warm") == []
    assert asked == ["promote-part/node-host-1"]  # no answer from the catalog: Prefect is asked
