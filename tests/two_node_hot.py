"""A two-node world for hot-tier retention tests: two private hot roots (one per simulated node, as
each node's own disk), one shared warm tier, one SQLite catalog, retention.yaml beside each node's
ckptflow.yaml."""

from __future__ import annotations

from pathlib import Path

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, NodePart
from ckptflow.storage.posix_tier import PosixTier

RUN = "n"
HOSTS = ("host-a", "host-b")
POLICY = """\
sdc_detection_window: 1h
grace_period: 1d
tiers:
  hot:
    price: {per_gb_month: 0.0}
    rules: [{keep_last: 1}]
  warm:
    price: {per_gb_month: 0.03}
    rules: [{keep_last: 10}]
"""


def build_two_node_world(tmp: Path) -> dict[str, Path]:
    """Steps 1..5 saved by two nodes (node 0 on host-a, node 1 on host-b); host-b died before its part
    of 5. Warm holds 1, 3, 4 whole; its copy of 2 vanished (the catalog still says READY); 5 is not
    promoted yet. Returns each host's config path."""
    url = f"sqlite:///{tmp / 'catalog.db'}"
    configs = {}
    for host in HOSTS:
        (tmp / host).mkdir()
        configs[host] = tmp / host / "ckptflow.yaml"
        configs[host].write_text(
            f"catalog: {url}\ntiers:\n  hot: {{kind: posix, root: {tmp / host / 'hot'}}}\n"
            f"  warm: {{kind: posix, root: {tmp / 'warm'}}}\n"
        )
        (tmp / host / "retention.yaml").write_text(POLICY)
    warm = PosixTier("warm", tmp / "warm")
    catalog = Catalog.open(url)
    nodes = tuple(NodePart(i, h, (i,)) for i, h in enumerate(HOSTS))
    try:
        for step in range(1, 6):
            full = tmp / "whole" / f"step-{step}"
            full.mkdir(parents=True)
            entries = []
            for i in range(2):
                data = bytes([step, i]) * 500
                (full / f"__{i}_0.distcp").write_bytes(data)
                entries.append(FileEntry(f"__{i}_0.distcp", len(data), checksums.checksum_bytes(data), i, i))
            manifest = Manifest(RUN, step, 2, f"s{step}", tuple(entries), nodes=nodes)
            (full / MANIFEST_NAME).write_bytes(manifest.to_json())
            for i, host in enumerate(HOSTS):
                if host == "host-b" and step == 5:
                    continue
                part = tmp / host / "hot" / RUN / f"step-{step}"
                part.mkdir(parents=True)
                (part / MANIFEST_NAME).write_bytes(manifest.to_json())
                (part / f"__{i}_0.distcp").write_bytes((full / f"__{i}_0.distcp").read_bytes())
            cid = catalog.record_committed(
                RUN,
                step,
                f"s{step}",
                world_size=2,
                manifest_checksum=checksums.checksum_bytes(manifest.to_json()),
                bytes=manifest.total_bytes,
                file_count=2,
                metrics={},
                hot_uri=str(tmp / "host-a" / "hot" / RUN / f"step-{step}"),
                event_payload={},
            )
            if step <= 4:
                catalog.set_replica_state(cid, "warm", ReplicaState.READY, uri=warm.put(full, manifest).uri)
        warm.delete(RUN, 2)  # vanished behind the catalog's back
    finally:
        catalog.dispose()
    return configs
