"""Every reader of a manifest checks its digest: the training side's save, restore, tiers, sync, and
scrub's comparison with the catalog's ``manifest_checksum``.

The tamper is a changed digit in a real manifest file (a metric, the step), the file otherwise
valid JSON in every field: before the digest, every reader accepted it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ckptflow.catalog import Catalog, sync_from_root
from ckptflow.pipeline.replicas import check_against_catalog, manifest_mismatch
from ckptflow.storage import checksums, layout
from ckptflow.storage.manifest import MANIFEST_NAME, content_digest, parse_manifest, read_manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.verify import verify_checkpoint
from ckptflow.training_hooks import Checkpointer, ModelState

RUN = "digest"


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 4)
    return {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}


def _save(hot: Path, url: str | None, steps: list[int]) -> dict:
    """Save ``steps`` of the run under the hot root ``hot`` (in ``hot/digest/step-N``)."""
    state = _state(0)
    with Checkpointer(RUN, hot, catalog=url) as ckpt:
        assert ckpt.restore(state) == 0
        for step in steps:
            assert ckpt.save(step, state, metrics={"loss": 0.5 + step})
            ckpt.wait()
    return state


def _change_a_digit(directory: Path, old: bytes, new: bytes) -> None:
    path = directory / MANIFEST_NAME
    data = path.read_bytes()
    assert data.count(old) == 1, data
    path.write_bytes(data.replace(old, new))


def test_a_saved_manifest_carries_its_digest_and_the_catalog_its_bytes_crc(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    _save(tmp_path / "hot", url, [3])
    data = (tmp_path / "hot" / RUN / "step-3" / MANIFEST_NAME).read_bytes()
    body = json.loads(data)
    assert body["digest"] == content_digest(body)
    assert parse_manifest(data).metrics == {"loss": 3.5}
    catalog = Catalog.open(url)
    try:
        (cp,) = catalog.checkpoints(RUN)
        assert cp.manifest_checksum == checksums.checksum_bytes(data)
    finally:
        catalog.dispose()


def test_restore_refuses_a_manifest_with_a_changed_metric_and_falls_back(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    root = hot / RUN
    _save(hot, None, [1, 2])
    _change_a_digit(root / "step-2", b'"loss": 2.5', b'"loss": 2.4')
    state = _state(1)
    with Checkpointer(RUN, hot) as ckpt:
        assert ckpt.restore(state) == 1  # was 2: the changed manifest was trusted
        report = ckpt.stats.restore
    assert report is not None and report.rejected and report.rejected[0][0] == 2
    assert "changed after it was written" in report.rejected[0][1]
    quarantined = [e for e in layout.scan(root) if e.kind == "quarantined"]
    assert [e.step for e in quarantined] == [2]  # moved aside, never deleted


def test_tiers_and_verify_refuse_it(tmp_path: Path) -> None:
    tier = PosixTier("warm", tmp_path / "warm")
    root = tier.run_dir(RUN)
    _save(tier.root, None, [4])
    _change_a_digit(root / "step-4", b'"step": 4', b'"step": 5')
    report = tier.verify(RUN, 4)
    assert not report.ok and report.problems[0].kind == "manifest"
    assert "changed after it was written" in report.problems[0].detail
    local = verify_checkpoint(root / "step-4")
    assert not local.ok and "changed after it was written" in local.problems[0].detail


def test_sync_reports_it_unreadable_instead_of_recording_it(tmp_path: Path) -> None:
    root = tmp_path / "hot" / RUN
    _save(tmp_path / "hot", None, [6])
    _change_a_digit(root / "step-6", b'"loss": 6.5', b'"loss": 0.5')
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        report = sync_from_root(catalog, str(root), run=RUN)
        assert report.unreadable == [str(root / "step-6")]
        assert catalog.checkpoints(RUN) == []  # was: a row with loss 0.5
    finally:
        catalog.dispose()


def test_scrub_check_finds_a_manifest_that_is_not_the_committed_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"catalog: {url}\ntiers:\n"
        f"  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n"
        f"  warm: {{kind: posix, root: {tmp_path / 'warm'}}}\n"
    )
    hot, warm = PosixTier("hot", tmp_path / "hot"), PosixTier("warm", tmp_path / "warm")
    _save(hot.root, url, [8])
    warm.put(hot.path(RUN, 8), read_manifest(hot.path(RUN, 8)))
    catalog = Catalog.open(url)
    try:
        (cp,) = catalog.checkpoints(RUN)
    finally:
        catalog.dispose()
    ok = {"ok": True, "problems": [], "uri": warm.uri(RUN, 8), "bytes": 1}
    assert manifest_mismatch(str(config), RUN, 8, "warm", cp.manifest_checksum) is None
    assert check_against_catalog(ok, str(config), cp, "warm") == ok

    # Another valid manifest in its place: a changed metric, sealed with a digest of its own.
    path = warm.path(RUN, 8) / MANIFEST_NAME
    body = json.loads(path.read_bytes())
    body["metrics"]["loss"] = 0.125
    body["digest"] = content_digest(body)
    path.write_bytes(json.dumps(body, indent=1).encode())
    assert warm.verify(RUN, 8).ok  # the manifest and the files agree with each other ...
    problem = manifest_mismatch(str(config), RUN, 8, "warm", cp.manifest_checksum)
    assert (
        problem is not None and "not the manifest that was committed" in problem
    )  # ... not with the catalog
    failed = check_against_catalog(ok, str(config), cp, "warm")
    assert failed["ok"] is False and failed["problems"] == [problem]
