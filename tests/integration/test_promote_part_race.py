"""Two nodes finishing their parts at the same moment, on a real Prefect server: the other node
publishes the step between this node's copy and its look at what the tier still lacks. The copied
files then live in the published copy, not the incoming directory, so everything looks lacking;
the run must report the step published, not wait for (and ask Prefect about) parts that arrived.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from two_node_hot import RUN, build_two_node_world

from ckptflow.catalog import Catalog
from ckptflow.services.prefect_server import PrefectServer
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest
from ckptflow.storage.posix_tier import PosixTier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_step_published_by_the_other_node_right_after_this_copy_is_reported_published(
    tmp_path: Path, shared_prefect: PrefectServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptflow.flows.promote_part as promote_part_module
    from ckptflow.flows.promote_part import promote_part

    configs = build_two_node_world(tmp_path)  # step 5: host-a holds its part, warm has none of it
    whole = tmp_path / "whole" / "step-5"
    warm = PosixTier("warm", tmp_path / "warm")
    copy = promote_part_module._PartJob._copy

    def copy_then_the_other_node_publishes(self: Any, *args: Any) -> Any:
        done = copy(self, *args)
        # host-b, last to finish, copies its part and publishes the step (manifest last, rename).
        warm.put(whole, read_manifest(whole))
        return done

    monkeypatch.setattr(promote_part_module._PartJob, "_copy", copy_then_the_other_node_publishes)
    row = promote_part(RUN, 5, str(configs["host-a"]), "host-a")
    assert row["action"] == "already published", row
    assert "waiting_for" not in row and "catch_up" not in row
    assert row["files"] == 1  # host-a did copy its own part
    assert (tmp_path / "warm" / RUN / "step-5" / MANIFEST_NAME).is_file()
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        (checkpoint,) = [c for c in catalog.checkpoints(RUN) if c.step == 5]
        (replica,) = [r for r in catalog.replicas(checkpoint.id) if r.tier == "warm"]
        assert not (replica.reason or "").startswith("waiting"), replica
    finally:
        catalog.dispose()
