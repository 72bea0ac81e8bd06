"""Plain functions behind ``scrub``: every replica checked, judged and repaired on its own.

No Prefect here (the tasks in :mod:`ckptflow.tasks.scrub_tasks` wrap these; the flow arranges them).

- :func:`check_replica` verifies one replica against its manifest (POSIX: re-hash; S3: the stored
  full-object checksums) and against the manifest the catalog recorded at commit. A read that fails
  (an ``OSError``, a timeout, an S3 5xx or throttling reply, an endpoint that is down: any
  ``TierError``) proves nothing about the bytes: the verdict is ``retry later``, never ``corrupt``.
- :func:`choose_repair_source` picks the copy to repair from: the hottest other tier whose copy
  verifies and whose manifest is the catalog's.
- :func:`settle` acts on a verdict: a replica that verifies is READY with a new ``verified_at``;
  a replica that could not be read keeps its state with a note;
  a corrupt one is marked CORRUPT, repaired, verified again and marked READY. A repair that raises
  is recorded on that replica (it stays CORRUPT, the reason says why) and returned as a row, so the
  caller goes on with the next replica.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptflow.catalog import Catalog, LeaseKey, ReplicaState
from ckptflow.pipeline.leases import LeaseHeld, hold, hold_all_or_raise
from ckptflow.pipeline.replicas import bytes_mismatch
from ckptflow.storage.manifest import MANIFEST_NAME, Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.tier import Progress, Tier, TierConfigurationError, TierError
from ckptflow.storage.verify import FileProblem

# What a failed read raises: none of it says anything about the bytes.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (OSError, TimeoutError, TierError)

OK, CORRUPT, RETRY_LATER = "ok", "corrupt", "retry later"
REPAIRED, REPAIR_FAILED, ERROR = "repaired", "repair failed", "error"
FAILED_VERDICTS = (REPAIR_FAILED, ERROR)  # what makes a scrub run fail, after every replica was seen
SCRUBBED_STATES = (ReplicaState.READY, ReplicaState.CORRUPT)


@dataclass(frozen=True)
class ScrubTarget:
    """One replica to scrub, with what the catalog recorded about its checkpoint."""

    checkpoint_id: int
    run: str
    step: int
    tier: str
    manifest_checksum: str | None = None


@dataclass(frozen=True)
class Check:
    """What :func:`check_replica` found: ``verdict`` is ok, corrupt or retry later."""

    verdict: str
    uri: str
    problems: list[str] = field(default_factory=list)
    bytes: int = 0

    @property
    def detail(self) -> str:
        return "; ".join(self.problems[:5])


def scrub_targets(catalog: Catalog, tiers: list[str]) -> list[ScrubTarget]:
    """Every READY or CORRUPT replica on ``tiers`` of every checkpoint, newest step first."""
    return [
        ScrubTarget(int(cp.id), cp.run, cp.step, replica.tier, cp.manifest_checksum)  # type: ignore[arg-type]
        for cp in catalog.checkpoints()
        for replica in catalog.replicas(cp.id)  # type: ignore[arg-type]
        if replica.tier in tiers and replica.state in SCRUBBED_STATES
    ]


def verdict_of(problems: list[FileProblem]) -> str:
    """ok without problems; retry later when every problem is a read that failed (``unreadable``:
    the file is there but could not be read now); corrupt otherwise."""
    if not problems:
        return OK
    return RETRY_LATER if all(p.kind == "unreadable" for p in problems) else CORRUPT


def check_replica(tier: Tier, target: ScrubTarget, progress: Progress | None = None) -> Check:
    """Verify ``target`` on ``tier`` and that its manifest is the catalog's; a read that failed is
    ``retry later``, except a request the tier refused for good (TierConfigurationError: wrong
    credentials, access denied, no such bucket), which is raised."""
    uri = tier.uri(target.run, target.step)
    try:
        report = tier.verify(target.run, target.step, progress)
        verdict = verdict_of(report.problems) if report.manifest is not None or report.problems else CORRUPT
        if verdict == OK and target.manifest_checksum:
            mismatch = bytes_mismatch(
                tier.read_file(target.run, target.step, MANIFEST_NAME), target.manifest_checksum
            )
            if mismatch is not None:
                return Check(CORRUPT, report.uri, [mismatch])
    except TRANSIENT_ERRORS as exc:
        if isinstance(exc, TierConfigurationError):
            raise  # no retry fixes wrong credentials or a missing bucket: the run fails, naming it
        return Check(RETRY_LATER, uri, [f"unreadable now ({type(exc).__name__}: {exc})"])
    nbytes = report.manifest.total_bytes if report.manifest is not None else 0
    return Check(verdict, report.uri, [str(p) for p in report.problems], nbytes)


def choose_repair_source(tiers: dict[str, Tier], target: ScrubTarget) -> tuple[str | None, list[str]]:
    """(the hottest tier other than the target's whose copy checks out, why each hotter one did not).

    ``tiers`` in order, hottest first (as ``ckptflow.yaml`` lists them). A candidate that cannot be
    read now is passed over like a corrupt one: a repair must start from a copy proven right.
    """
    passed_over = []
    for name, tier in tiers.items():
        if name == target.tier:
            continue
        check = check_replica(tier, target)
        if check.verdict == OK:
            return name, passed_over
        passed_over.append(f"{name}: {check.verdict} ({check.detail or 'no copy'})")
    return None, passed_over


def _require_manifest(tier: Tier, run: str, step: int) -> Manifest:
    manifest = tier.read_manifest(run, step)
    if manifest is None:
        raise ValueError(f"{tier.name} holds no committed copy of {run} step {step} to repair from")
    return manifest


def repair_from(target: Tier, source: Tier, run: str, step: int) -> str:
    """Replace the target tier's copy of (run, step) with the source's (fetched to a local scratch
    directory first when the source is remote, every checksum verified while downloading); the uri."""
    target.delete(run, step)
    if isinstance(source, PosixTier):
        return target.put(source.path(run, step), _require_manifest(source, run, step)).uri
    scratch = Path(tempfile.mkdtemp(prefix="ckptflow-repair-"))
    try:
        local = scratch / f"step-{step}"
        source.fetch(run, step, local)
        return target.put(local, _require_manifest(source, run, step)).uri
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def leased_repair(catalog: Catalog, target: Tier, source: Tier, run: str, step: int, ttl_s: float) -> str:
    """:func:`repair_from` under the replica's lease (run, step, tier): a writer holding it (a
    promotion re-copying the replica) is waited for up to one lease time to live, then
    :class:`~ckptflow.pipeline.leases.LeaseHeld` is raised and nothing is touched."""
    key = LeaseKey(run, step, target.name)
    with hold(catalog, [key], "scrub-repair", ttl_s, wait_s=ttl_s, work_uri=target.uri(run, step)) as held:
        hold_all_or_raise(held, f"repair of {key} deferred")
        return repair_from(target, source, run, step)


def row(target: ScrubTarget, verdict: str, detail: str = "") -> dict[str, Any]:
    """One line of the scrub artifact."""
    return {"run": target.run, "step": target.step, "tier": target.tier, "verdict": verdict, "detail": detail}


def settle(
    catalog: Catalog,
    tiers: dict[str, Tier],
    target: ScrubTarget,
    check: Check,
    repair: bool = True,
    lease_ttl_s: float = 120.0,
) -> dict[str, Any]:
    """Record ``check`` for ``target`` and, for a corrupt replica, repair it (see the module docstring)."""
    if check.verdict == OK:
        # Re-stamps verified_at: the catalog says when each replica was last proven (a CORRUPT one
        # that verifies again, repaired by hand, is READY again).
        catalog.set_replica_state(
            target.checkpoint_id, target.tier, ReplicaState.READY, uri=check.uri, bytes=check.bytes
        )
        return row(target, OK)
    if check.verdict == RETRY_LATER:
        catalog.note_replica(
            target.checkpoint_id,
            target.tier,
            "unverified",
            f"scrub could not read it (retry later): {check.detail}",
        )
        return row(target, RETRY_LATER, check.detail)
    reason = check.detail or "replica missing"
    catalog.set_replica_state(target.checkpoint_id, target.tier, ReplicaState.CORRUPT, reason=reason)
    if not repair:
        return row(target, CORRUPT, reason)
    source, passed_over = choose_repair_source(tiers, target)
    if source is None:
        why = "; ".join(passed_over) or "no other tier"
        return row(target, CORRUPT, f"{reason} (no intact replica to repair from: {why})")
    try:
        uri = leased_repair(catalog, tiers[target.tier], tiers[source], target.run, target.step, lease_ttl_s)
        again = check_replica(tiers[target.tier], target)
    except LeaseHeld as exc:  # another writer is re-making this replica: the next scrub checks it
        deferred = f"{reason}; repair deferred: {exc}"
        catalog.set_replica_state(target.checkpoint_id, target.tier, ReplicaState.CORRUPT, reason=deferred)
        return row(target, CORRUPT, deferred)
    except Exception as exc:  # noqa: BLE001 - recorded on this replica; the scrub goes on with the next
        failure = f"{reason}; repair from {source} failed: {type(exc).__name__}: {exc}"
        catalog.set_replica_state(target.checkpoint_id, target.tier, ReplicaState.CORRUPT, reason=failure)
        return row(target, REPAIR_FAILED, failure)
    if again.verdict != OK:
        failure = f"{reason}; the copy repaired from {source} does not verify: {again.detail}"
        catalog.set_replica_state(target.checkpoint_id, target.tier, ReplicaState.CORRUPT, reason=failure)
        return row(target, REPAIR_FAILED, failure)
    catalog.set_replica_state(
        target.checkpoint_id, target.tier, ReplicaState.READY, uri=uri, bytes=again.bytes, reason=None
    )
    return row(target, REPAIRED, f"{reason} -> repaired from {source}")


def record_error(catalog: Catalog, target: ScrubTarget, exc: BaseException) -> dict[str, Any]:
    """The row for a replica whose handling raised (a catalog write, a tier that could not be built):
    noted on the replica when the catalog still answers; the scrub goes on either way."""
    detail = f"scrub failed on this replica: {type(exc).__name__}: {exc}"
    try:
        catalog.note_replica(target.checkpoint_id, target.tier, "scrub_failed", detail)
    except Exception as note_exc:  # noqa: BLE001 - the row below still reports the first error
        detail += f" (and it could not be noted in the catalog: {type(note_exc).__name__}: {note_exc})"
    return row(target, ERROR, detail)
