"""Reconcile's decisions as plain functions: which checkpoints need promoting, which are done, what
the outbox still owes, which replicas to look for. :mod:`ckptflow.flows.reconcile` arranges the
tasks around them; no Prefect here.

A checkpoint is *pending* when it is live, published on the first colder tier (warm), and some colder
tier that should hold it shows no committed copy of it (a lost ``published`` event, a failed
promotion). ``wanted(run, step, tier)`` says whether a tier should hold a checkpoint at all (the
retention policy may skip a tier: :mod:`ckptflow.pipeline.admission`); by default every tier should.
Reconcile's own ``wanted`` is :func:`catch_up_wanted`. A checkpoint a writer holds a live lease on is
never pending, nor is its staged event owed: its promotion is in flight, not missed.

Every action reconcile takes is one row of its report (:func:`row`): action, run, step, detail.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ckptflow.catalog import LIVE_STATES, Catalog, Checkpoint, OutboxEvent, ReplicaState
from ckptflow.pipeline.lease_cleanup import being_written, still_wanted
from ckptflow.pipeline.rows import RowAction, action_row
from ckptflow.policy.config import CkptflowConfig
from ckptflow.storage.events import STAGED_EVENT
from ckptflow.storage.tier import Tier

Wanted = Callable[[str, int, str], bool]


def _everywhere(run: str, step: int, tier: str) -> bool:
    return True


def retention_repair_rows(repairs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The report's rows for the repairs of a retention apply killed mid-way
    (:func:`ckptflow.pipeline.retention.reconcile_retention`)."""
    return [
        action_row(
            RowAction.RETENTION_REPAIRED,
            repair.get("run", ""),
            repair.get("step"),
            str(repair.get("detail", repair)),
        )
        for repair in repairs
    ]


def missing_tiers(
    run: str, step: int, tiers: dict[str, Tier], colder: Sequence[str], wanted: Wanted = _everywhere
) -> list[str]:
    """The tiers of ``colder`` that should hold (run, step) and show no committed copy of it."""
    return [t for t in colder if wanted(run, step, t) and tiers[t].read_manifest(run, step) is None]


def pending_promotions(
    checkpoints: Iterable[Checkpoint],
    tiers: dict[str, Tier],
    first: str,
    colder: Sequence[str],
    wanted: Wanted = _everywhere,
) -> list[Checkpoint]:
    """The live checkpoints published on ``first`` that a tier of ``colder`` (beyond ``first``) still
    lacks, newest step first (the most useful restore points catch up first)."""
    beyond = [t for t in colder if t != first]
    pending = [
        cp
        for cp in checkpoints
        if cp.state in LIVE_STATES
        and tiers[first].read_manifest(cp.run, cp.step) is not None
        and missing_tiers(cp.run, cp.step, tiers, beyond, wanted)
    ]
    return sorted(pending, key=lambda cp: (-cp.step, cp.run))


def live_checkpoints(catalog: Catalog) -> list[Checkpoint]:
    return [cp for cp in catalog.checkpoints() if cp.state in LIVE_STATES]


def catch_up_wanted(
    catalog: Catalog, live: Iterable[Checkpoint], colder: Sequence[str], first: str, policy_wants: Wanted
) -> Wanted:
    """Whether a colder tier should hold a live checkpoint, as reconcile asks it: the first colder
    tier always gets every part (the nodes' disks may vanish); colder tiers only what the retention
    policy keeps there (``policy_wants``: a skipped tier is not "missed"); a replica retention deleted
    is never wanted again."""
    deleted = {(cp.run, cp.step): set(colder) - set(still_wanted(catalog, cp, list(colder))) for cp in live}

    def wanted(run: str, step: int, tier: str) -> bool:
        if tier in deleted.get((run, step), ()):
            return False
        return tier == first or policy_wants(run, step, tier)

    return wanted


def missed_promotions(
    catalog: Catalog,
    live: Iterable[Checkpoint],
    tiers: dict[str, Tier],
    first: str,
    colder: Sequence[str],
    wanted: Wanted,
) -> list[Checkpoint]:
    """:func:`pending_promotions` less those a writer is promoting now (a live lease: not missed)."""
    return [
        cp
        for cp in pending_promotions(live, tiers, first, colder, wanted)
        if not being_written(catalog, cp.run, cp.step)
    ]


class OutboxAction(enum.Enum):
    """What reconcile does with one undelivered outbox event."""

    DONE = "done"  # every wanted colder tier holds the checkpoint: mark it delivered
    IN_FLIGHT = "in flight"  # its promotion holds a live lease: not missed (looked at next pass)
    REPOST = "repost"  # post the staged event again, so every node's agent promotes its part
    NOT_STAGED = "not staged"  # another kind of event: not reconcile's to deliver


def outbox_action(
    catalog: Catalog, event: OutboxEvent, tiers: dict[str, Tier], colder: Sequence[str], wanted: Wanted
) -> OutboxAction:
    """What the outbox still owes for ``event`` (see :class:`OutboxAction`)."""
    if event.kind != STAGED_EVENT:
        return OutboxAction.NOT_STAGED
    if not missing_tiers(event.run, event.step, tiers, colder, wanted):
        return OutboxAction.DONE
    if being_written(catalog, event.run, event.step):
        return OutboxAction.IN_FLIGHT
    return OutboxAction.REPOST


def stale_age_s(config: CkptflowConfig, tier: str) -> float:
    """How old interrupted work on ``tier`` must be before reconcile cleans it: an upload on cold
    (S3), a partial directory elsewhere."""
    return config.promote.stale_upload_age_s if tier == "cold" else config.promote.stale_partial_age_s


def ready_colder_replicas(catalog: Catalog) -> list[tuple[Checkpoint, str]]:
    """(checkpoint, tier) of every READY replica off the hot tier: the ones whose files reconcile
    checks are still there (a node's own disk is its agent's to check)."""
    return [
        (checkpoint, replica.tier)
        for checkpoint in catalog.checkpoints()
        for replica in catalog.replicas(checkpoint.id)
        if replica.tier != "hot" and replica.state == ReplicaState.READY
    ]
