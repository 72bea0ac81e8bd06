"""The node-housekeeping flow (what each node's agent runs on a schedule) applies hot-tier retention
to its own node's disk: run for each of two nodes with private hot roots against a real Prefect
server, each deletes only its own parts and keeps its newest complete checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from two_node_hot import RUN, build_two_node_world

from ckptflow.services.prefect_server import PrefectServer
from ckptflow.storage import layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_each_nodes_housekeeping_run_deletes_its_own_hot_parts(
    tmp_path: Path, shared_prefect: PrefectServer
) -> None:
    from ckptflow.flows.node_housekeeping import node_housekeeping

    configs = build_two_node_world(tmp_path)
    # max_promotions=0: only the retention side is under test (host-a's step 5 is not on warm yet).
    rows_a = node_housekeeping(str(configs["host-a"]), node="host-a", max_promotions=0)
    rows_b = node_housekeeping(str(configs["host-b"]), node="host-b", max_promotions=0)

    def deleted(rows: list[dict]) -> list[int]:
        return sorted(r["step"] for r in rows if r["action"] == "hot retention: deleted")

    assert deleted(rows_a) == [1, 3, 4] and deleted(rows_b) == [1, 3]
    assert sorted(layout.committed_steps(tmp_path / "host-a" / "hot" / RUN)) == [2, 5]
    assert sorted(layout.committed_steps(tmp_path / "host-b" / "hot" / RUN)) == [2, 4]
    kept_b = {r["step"]: r["detail"] for r in rows_b if r["action"] == "hot retention: kept"}
    assert kept_b[4] == "the newest complete checkpoint on this node"
