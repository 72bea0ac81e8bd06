"""Plain function: is a replica's manifest the one the catalog recorded at commit?

A manifest checks its own content (its ``digest``), but a manifest replaced by another valid one
(another save's, or a digest-less one from before the field existed with a digit changed) passes
that check. The catalog keeps the CRC64NVME of the manifest's bytes as written at commit
(``manifest_checksum``), and every tier publishes exactly those bytes: scrub compares the two.
"""

from __future__ import annotations

from typing import Any

from ckptflow.pipeline.tiers import load
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME
from ckptflow.storage.tier import TierError


def manifest_mismatch(config_path: str, run: str, step: int, tier: str, recorded: str | None) -> str | None:
    """Why ``tier``'s manifest of (run, step) is not the catalog's (``recorded``: its
    ``manifest_checksum``), or None when it is, or when the catalog recorded none."""
    if not recorded:
        return None
    _, tiers = load(config_path)
    try:
        data = tiers[tier].read_file(run, step, MANIFEST_NAME)
    except (TierError, OSError) as exc:
        return f"{MANIFEST_NAME}: unreadable ({exc})"
    return bytes_mismatch(data, recorded)


def bytes_mismatch(data: bytes, recorded: str) -> str | None:
    """Why manifest bytes ``data`` are not the ones the catalog recorded (``recorded``), or None."""
    actual = checksums.checksum_bytes(data)
    if actual != recorded:
        return (
            f"{MANIFEST_NAME}: manifest (crc64nvme {actual} of its {len(data)} bytes, the catalog recorded "
            f"{recorded} at commit: not the manifest that was committed)"
        )
    return None


def check_against_catalog(report: dict[str, Any], config_path: str, cp: Any, tier: str) -> dict[str, Any]:
    """A ``verify_replica`` report, failed as well if the replica's manifest is not the catalog's."""
    if not report["ok"]:
        return report
    problem = manifest_mismatch(config_path, cp.run, cp.step, tier, cp.manifest_checksum)
    return report if problem is None else {**report, "ok": False, "problems": [problem]}
