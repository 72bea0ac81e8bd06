"""What the catalog records for a committed checkpoint, built from its manifest alone.

The coordinator records each commit right after the decision. When that write never happened (the
process was killed between the rename and the catalog write, or the catalog was down), the same
record is built again from the manifest on disk: by restore, which has just verified the manifest of
the step it chose, and by ``ckptflow import``. One function, so both write the same row, file list,
hot replica and outbox event (the ``staged`` payload that starts the promotion).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptflow.storage.checksums import checksum_bytes
from ckptflow.storage.manifest import Manifest


def staged_payload(
    manifest: Manifest, manifest_json: bytes, hot_uri: str, hosts: Sequence[str]
) -> dict[str, Any]:
    """The ``ckptflow.checkpoint.staged`` payload: totals, and each node's part (``hosts[k]``: the
    host of node ``k``, whose hot root holds that part at ``hot_uri``)."""
    nodes = [
        {
            "node": k,
            "host": host,
            "hot_uri": hot_uri,
            "files": [f.path for f in manifest.part_files(k)],
            "bytes": manifest.part_bytes(k),
        }
        for k, host in enumerate(hosts)
    ]
    return {
        "run": manifest.run,
        "step": manifest.step,
        "hot_uri": hot_uri,
        "bytes": manifest.total_bytes,
        "file_count": len(manifest.files),
        "manifest_checksum": checksum_bytes(manifest_json),
        "nodes": nodes,
    }


def committed_record(
    manifest: Manifest, manifest_json: bytes, hot_uri: str, hosts: Sequence[str]
) -> dict[str, Any]:
    """Keyword arguments of ``Catalog.record_committed(run, step, save_id, **record)``."""
    payload = staged_payload(manifest, manifest_json, hot_uri, hosts)
    return {
        "world_size": manifest.world_size,
        "manifest_checksum": payload["manifest_checksum"],
        "bytes": manifest.total_bytes,
        "file_count": len(manifest.files),
        "metrics": dict(manifest.metrics),
        "hot_uri": hot_uri,
        "event_payload": payload,
        "files": manifest.files,
    }


def save_time_hosts(manifest: Manifest, default: str) -> list[str]:
    """The host of each node as at save time (format 1 manifests name none: ``default``)."""
    by_node = {part.node: part.host for part in manifest.nodes}
    count = max([*by_node, *(f.node for f in manifest.files)], default=0) + 1
    return [by_node.get(k) or default for k in range(count)]
