"""Scrub, on a real Prefect server: a warm replica whose manifest is not the one the catalog recorded
at commit is found, marked corrupt and repaired from the hot copy.

The replacement manifest is valid in every way a tier can check alone (its files match it, its own
digest matches its content): only the catalog's ``manifest_checksum`` tells it apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.services.prefect_server import PrefectServer
from ckptflow.storage.manifest import MANIFEST_NAME, content_digest, read_manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.training_hooks import Checkpointer, ModelState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = "scrub-manifest"


def test_scrub_repairs_a_replica_whose_manifest_is_not_the_committed_one(
    tmp_path: Path, shared_prefect: PrefectServer
) -> None:
    from ckptflow.flows.scrub import scrub

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"catalog: {url}\ntiers:\n"
        f"  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n"
        f"  warm: {{kind: posix, root: {tmp_path / 'warm'}, price_per_gb_month: 0.03}}\n"
    )
    hot, warm = PosixTier("hot", tmp_path / "hot"), PosixTier("warm", tmp_path / "warm")
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    with Checkpointer(RUN, hot.root, catalog=url) as ckpt:
        ckpt.restore({"app": ModelState(model)})
        assert ckpt.save(10, {"app": ModelState(model)}, metrics={"loss": 0.75})
    committed = (hot.path(RUN, 10) / MANIFEST_NAME).read_bytes()
    warm.put(hot.path(RUN, 10), read_manifest(hot.path(RUN, 10)))
    catalog = Catalog.open(url)
    try:
        (cp,) = catalog.checkpoints(RUN)
        catalog.set_replica_state(cp.id, "warm", ReplicaState.READY, uri=warm.uri(RUN, 10), bytes=cp.bytes)
    finally:
        catalog.dispose()
    assert [(r["tier"], r["verdict"]) for r in scrub(str(config))] == [("warm", "ok")]

    replaced = warm.path(RUN, 10) / MANIFEST_NAME
    body = json.loads(replaced.read_bytes())
    body["metrics"]["loss"] = 0.25  # a better loss than the run ever had
    body["digest"] = content_digest(body)
    replaced.write_bytes(json.dumps(body, indent=1).encode())
    assert warm.verify(RUN, 10).ok  # the tier alone cannot tell

    (row,) = scrub(str(config))
    assert (row["tier"], row["verdict"]) == ("warm", "repaired"), row
    assert "not the manifest that was committed" in row["detail"]
    assert replaced.read_bytes() == committed
    catalog = Catalog.open(url)
    try:
        states = {r.tier: r.state for r in catalog.replicas(cp.id)}
        events = [e.kind for e in catalog.events(RUN)]
    finally:
        catalog.dispose()
    assert states == {"hot": ReplicaState.READY, "warm": ReplicaState.READY}
    assert "replica.corrupt" in events  # marked corrupt before the repair
