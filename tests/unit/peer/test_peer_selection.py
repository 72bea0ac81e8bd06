"""Who holds which part (NVRx's n+J, n+2J, ... rule as a ring), and how parts are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptflow.peer import PartId, holders_of, parts_held_by, peers_for, replica_dir, replica_entries
from ckptflow.storage.manifest import FileEntry, Manifest, NodePart

CRC = "AAAAAAAAAAA="


def test_peers_are_n_plus_j_n_plus_2j_modulo_the_node_count() -> None:
    assert peers_for(0, 4, 2) == [1]
    assert peers_for(3, 4, 2) == [0]
    assert peers_for(5, 16, 3, jump=4) == [9, 13]
    assert peers_for(14, 16, 3, jump=4) == [2, 6]
    assert peers_for(0, 1, 1) == []  # one node: no peer copies


def test_with_one_jump_per_failure_domain_every_copy_lies_in_another_domain() -> None:
    nodes_per_rack, racks = 4, 3
    count = nodes_per_rack * racks
    for node in range(count):
        racks_used = {h // nodes_per_rack for h in holders_of(node, count, 3, jump=nodes_per_rack)}
        assert len(racks_used) == 3, node


@pytest.mark.parametrize(
    ("count", "factor", "jump"), [(4, 2, 1), (5, 3, 2), (12, 3, 4), (7, 7, 3), (6, 1, 5)]
)
def test_the_ring_is_balanced_and_parts_held_by_inverts_peers_for(count: int, factor: int, jump: int) -> None:
    received = {n: 0 for n in range(count)}
    for node in range(count):
        peers = peers_for(node, count, factor, jump)
        assert len(peers) == len(set(peers)) == factor - 1 and node not in peers
        for peer in peers:
            received[peer] += 1
            assert node in parts_held_by(peer, count, factor, jump)
        assert sorted(parts_held_by(node, count, factor, jump)) == sorted(
            owner for owner in range(count) if node in peers_for(owner, count, factor, jump)
        )
    assert set(received.values()) == {factor - 1}  # every node receives as many parts as it sends


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 2, 3, 1), r"^replication\.factor: 3 copies .* has 2"),
        ((0, 4, 0, 1), r"^replication\.factor must be >= 1"),
        ((0, 4, 2, 0), r"^replication\.jump must be >= 1"),
        ((0, 8, 3, 4), r"^replication\.jump: with 8 nodes, jump 4 reaches only 2 distinct node"),
        ((0, 4, 2, 4), r"^replication\.jump: with 4 nodes, jump 4 reaches only 1 distinct node"),
        ((4, 4, 2, 1), r"^replication node must be in \[0, 4\)"),
        ((0, 0, 1, 1), r"^replication node_count must be >= 1"),
        ((0, 4, True, 1), r"^replication factor must be an integer"),
    ],
)
def test_invalid_choices_name_the_field(args: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        peers_for(*args)


def manifest(nodes: int) -> Manifest:
    files = [FileEntry(f"__{n}_0.distcp", 10, CRC, n, n) for n in range(nodes)]
    files.append(FileEntry(".metadata", 5, CRC, 0, 0))
    node_parts = tuple(NodePart(n, f"host-{n}", (n,)) for n in range(nodes))
    return Manifest("run-1", 7, nodes, "s-7", tuple(files), nodes=node_parts)


def test_a_part_is_named_by_the_save_time_node_index_and_node_count() -> None:
    m = manifest(3)
    assert PartId.of(m, 2) == PartId(2, 3) and PartId(2, 3).name == "part-2-of-3"
    assert PartId.parse("part-2-of-3") == PartId(2, 3)
    assert [e.path for e in replica_entries(m, 2)] == ["__2_0.distcp", ".metadata"]
    assert [e.path for e in replica_entries(m, 0)] == ["__0_0.distcp", ".metadata"]
    single = Manifest("run-1", 7, 1, "s", (FileEntry("a", 1, CRC), FileEntry(".metadata", 1, CRC)))
    assert PartId.of(single, 0) == PartId(0, 1) and len(replica_entries(single, 0)) == 2
    assert replica_dir(Path("/hot"), "run-1", 7, PartId(2, 3)) == Path("/hot/run-1/peers/part-2-of-3/step-7")


@pytest.mark.parametrize(
    "name", ["part-3-of-3", "part--1-of-3", "part-1-of-0", "part-1", "../part-0-of-1", 5]
)
def test_bad_part_names_are_refused(name: object) -> None:
    with pytest.raises(ValueError):
        PartId.parse(name)  # type: ignore[arg-type]


def test_a_node_the_save_did_not_have_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^owner_part: step 7 .* saved by nodes \[0, 1, 2\]; .* node 3"):
        PartId.of(manifest(3), 3)
