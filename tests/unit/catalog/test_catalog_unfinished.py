"""Catalog.record_unfinished: a removed partial directory ends its attempt's ``writing`` row, and
touches nothing else (no row created for a fetch's or a promotion's partial, no committed row
changed)."""

from __future__ import annotations

from typing import Any

from ckptflow.catalog import CheckpointState


def _commit(catalog: Any, step: int, save_id: str) -> None:
    catalog.record_committed(
        "r",
        step,
        save_id,
        world_size=1,
        manifest_checksum="AAAAAAAAAAA=",
        bytes=1,
        file_count=1,
        metrics={},
        hot_uri=f"/hot/r/step-{step}",
        event_payload={},
    )


def test_only_a_writing_row_becomes_abandoned(catalog: Any) -> None:
    catalog.record_writing("r", 5, "a-5-0", 2)
    _commit(catalog, 6, "a-6-1")
    assert catalog.record_unfinished("r", 5, "a-5-0", "unfinished: step-5.partial-a-5-0 removed") is True
    assert catalog.record_unfinished("r", 5, "a-5-0", "again") is False  # already abandoned
    assert catalog.record_unfinished("r", 6, "a-6-1", "a committed row") is False
    assert catalog.record_unfinished("r", 7, "fetch1234", "no such attempt") is False
    states = {(cp.step, cp.save_id): (cp.state, cp.reason) for cp in catalog.checkpoints("r")}
    assert states == {
        (6, "a-6-1"): (CheckpointState.COMMITTED, None),
        (5, "a-5-0"): (CheckpointState.ABANDONED, "unfinished: step-5.partial-a-5-0 removed"),
    }
    assert [e.kind for e in catalog.events("r")].count("checkpoint.abandoned") == 1
