"""A node's part damaged on its NVMe after the commit (one real bit flipped): ``promote-part`` copies
each file once, checks the copy's bytes against the manifest's CRC as it is made, and fails naming
the node and the file; the damaged file never reaches warm, warm is not published, the replica is not READY.
Real Prefect server (the session's pipeline bench)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pipeline_env import Bench, reporting, save_checkpoint

from ckptflow.storage.manifest import MANIFEST_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def made(pipeline_bench: Bench, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    with reporting(pipeline_bench.fork(tmp_path_factory.mktemp("damage"))) as running:
        yield running


def test_a_damaged_hot_file_fails_its_part_and_never_reaches_warm(made: Bench) -> None:
    from ckptflow.flows.promote_part import promote_part
    from ckptflow.pipeline.part_job import PartPromotionError

    save_checkpoint(made, "dmg", 1, mib=2)
    step_dir = Path(made.body["tiers"]["hot"]["root"]) / "dmg" / "step-1"
    files = json.loads((step_dir / MANIFEST_NAME).read_text())["files"]
    biggest = max(files, key=lambda f: f["size"])["path"]
    with open(step_dir / biggest, "r+b") as f:  # one bit, in the middle of the file
        f.seek((step_dir / biggest).stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))

    with pytest.raises(PartPromotionError) as raised:
        promote_part("dmg", 1, str(made.config))
    message = str(raised.value)
    assert "node " in message and biggest in message and "does not match its manifest" in message, message

    warm_run = made.warm_root() / "dmg"
    assert not (warm_run / "step-1").exists(), "warm published a part whose hot copy is damaged"
    landed = [p.name for p in warm_run.rglob("*") if p.is_file()] if warm_run.exists() else []
    assert not any(biggest in name for name in landed), landed  # not even under a temporary name
    catalog = made.catalog()
    try:
        cp = next(c for c in catalog.checkpoints("dmg") if c.step == 1)
        warm = {r.tier: r for r in catalog.replicas(cp.id)}.get("warm")
    finally:
        catalog.dispose()
    assert warm is None or warm.state.value != "ready"
