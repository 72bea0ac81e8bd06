"""Promotion's per-tier replica logic as a plain function: one colder tier, from the source copy.

:func:`promote_to_tier` is the state machine the ``promote`` flow runs for each colder tier: a replica
that is already there and verifies is only recorded READY; otherwise the replica goes PENDING ->
COPYING, the batches are copied, the copy is committed (manifest last) and verified again, and it
ends READY, or CORRUPT with the problems as its reason (then :class:`PromotionError`). The steps
that touch tiers and the catalog come in through :class:`TierSteps`: the flow passes its tasks (so
each is a task run in the Prefect UI, the batches spread over its task runner), a unit test the plain
functions. No Prefect here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptflow.pipeline.rows import RowAction


class PromotionError(RuntimeError):
    """A replica could not be made and verified; the copy it was made from is untouched."""


@dataclass(frozen=True)
class TierSteps:
    """How :func:`promote_to_tier` looks, records, copies, commits and verifies (the flow's tasks).

    ``present(config_path, run, step, tier)``: does the tier show a committed copy (its manifest);
    ``verify(config_path, run, step, tier)``: the ``verify_replica`` report (ok, uri, bytes, problems,
    seconds: its time inside the tier's verify call);
    ``record(config_path, checkpoint_id, tier, state, uri=, bytes=, reason=)``: a replica state;
    ``copy_batches(tier, batches)``: copy every batch, one result dict (files, bytes, seconds) each;
    ``commit(config_path, run, step, tier, source)``: publish the copy (manifest last), its URI;
    ``uri(run, step, tier)``: where the tier keeps (run, step).
    """

    present: Callable[[str, str, int, str], bool]
    verify: Callable[[str, str, int, str], dict[str, Any]]
    record: Callable[..., Any]
    copy_batches: Callable[[str, list[list[str]]], list[dict[str, Any]]]
    commit: Callable[[str, str, int, str, str], str]
    uri: Callable[[str, int, str], str]


def promote_to_tier(
    config_path: str,
    run: str,
    step: int,
    tier: str,
    source: str,
    batches: list[list[str]],
    checkpoint_id: int,
    steps: TierSteps,
) -> dict[str, Any]:
    """Make ``tier``'s replica of (run, step) from ``source`` and verify it; a report row (tier,
    action ``already verified`` or ``copied``, files, bytes, data_s, seconds, uri). Raises
    :class:`PromotionError` when the committed copy does not verify (recorded CORRUPT first).

    ``data_s``: the seconds inside the data-moving calls: the copy (its slowest batch: the batches
    run at once) and every verification of the tier's copy (re-hash, or S3's stored checksums);
    ``seconds - data_s`` is this tier's orchestration (catalog writes, task runs, the commit's
    manifest)."""
    started = time.perf_counter()
    # A manifest lookup (one stat or GET) decides whether there is anything to re-verify: a fresh
    # tier, the common case, costs no verification pass.
    if steps.present(config_path, run, step, tier):
        existing = steps.verify(config_path, run, step, tier)
    else:
        existing = {"ok": False, "uri": steps.uri(run, step, tier)}
    verified_s = float(existing.get("seconds", 0.0))
    if existing["ok"]:
        steps.record(config_path, checkpoint_id, tier, "ready", uri=existing["uri"], bytes=existing["bytes"])
        return {
            "tier": tier,
            "action": RowAction.ALREADY_VERIFIED,
            "files": 0,
            "bytes": 0,
            "data_s": round(verified_s, 3),
            "seconds": round(time.perf_counter() - started, 3),
            "uri": existing["uri"],
        }
    steps.record(config_path, checkpoint_id, tier, "pending", uri=existing["uri"])
    steps.record(config_path, checkpoint_id, tier, "copying", uri=existing["uri"])
    copied = steps.copy_batches(tier, batches)
    uri = steps.commit(config_path, run, step, tier, source)
    report = steps.verify(config_path, run, step, tier)
    if not report["ok"]:
        reason = "; ".join(report["problems"])
        steps.record(config_path, checkpoint_id, tier, "corrupt", uri=uri, reason=reason)
        raise PromotionError(f"{tier} replica of {run} step {step} failed verification: {report['problems']}")
    steps.record(config_path, checkpoint_id, tier, "ready", uri=uri, bytes=report["bytes"])
    return {
        "tier": tier,
        "action": RowAction.COPIED,
        "files": sum(c["files"] for c in copied),
        "bytes": sum(c["bytes"] for c in copied),
        "data_s": round(
            verified_s + max((c["seconds"] for c in copied), default=0.0) + float(report.get("seconds", 0.0)),
            3,
        ),
        "seconds": round(time.perf_counter() - started, 3),
        "uri": uri,
    }
