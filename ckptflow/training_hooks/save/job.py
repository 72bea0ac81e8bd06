"""One checkpoint save, from the staged copy to the committed checkpoint (runs in the background).

Every rank writes its shard files into ``step-N.partial-<id>/`` on its own node's hot root
(checksummed while written, fsynced) and reports them to its node's leader through the
coordination store. The leader commits the node's part; the coordinator (rank 0) decides the
checkpoint once every node's part is committed, or abandons it at the deadline naming the nodes and
ranks that missed it; every leader makes the decision durable on its node (global manifest last) or
removes its part. See :mod:`..commit.protocol` for the messages and :mod:`..commit.files` for the files.
No collective runs here: a straggler never blocks another rank's training loop.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable
from contextlib import ExitStack

import torch

import ckptflow
from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME, Manifest
from ckptflow.training_hooks.cluster.coord_store import StoreUnavailable
from ckptflow.training_hooks.commit import files as commit_files
from ckptflow.training_hooks.commit.after_commit import after_commit
from ckptflow.training_hooks.commit.protocol import CommitRound, Decision, DecisionOutcome
from ckptflow.training_hooks.save.records import SaveJob, SaveOutcome, SaveStats
from ckptflow.training_hooks.save.room import make_room_for_the_part, remove_abandoned_partials
from ckptflow.training_hooks.save.staging import wait_for
from ckptflow.training_hooks.save.writer import SaveAbandoned, make_writer

log = logging.getLogger("ckptflow.save")


def versions() -> dict[str, str]:
    return {"ckptflow": ckptflow.__version__, "torch": torch.__version__, "python": platform.python_version()}


def run_save_job(job: SaveJob) -> SaveStats:
    """Write this rank's files and take its part in the commit. Raises on a local failure (a disk
    error); coordination failures (a missed deadline, a lost store) end as ``abandoned``."""
    stats = job.stats
    wait_for(job.staging_event)
    job.on_phase("writing")
    topology = job.topology
    if topology.is_coordinator and job.catalog is not None:
        job.catalog.call("record_writing", job.run, job.step, job.save_id, topology.world_size)
    round_ = CommitRound(job.store, topology, job.run, job.save_id, job.started + job.deadline_s, job.grace_s)
    ops_before = job.store.ops
    if topology.is_coordinator and job.previous_save_id is not None:
        # Normally the previous round deleted itself; after a node died mid-round it could not.
        try:
            CommitRound(job.store, topology, job.run, job.previous_save_id, 0.0, 0.0).forget_round()
        except StoreUnavailable as exc:
            log.warning("could not delete the keys of save %s: %s", job.previous_save_id, exc)
    if topology.is_leader:
        remove_abandoned_partials(job)
        make_room_for_the_part(job)
    partial = job.partial_dir
    partial.mkdir(parents=True, exist_ok=True)
    try:
        with ExitStack() as stack:
            # Held until this rank has reported (a leader: until its part is committed), so clean-up
            # of an abandoned attempt never removes files a live rank is still writing.
            stack.enter_context(layout.writer_lock(partial, topology.rank))
            t0 = time.perf_counter()
            writer, fs = make_writer(partial, job.write_hook, _stop_when_abandoned(round_))
            writer.set_up_storage_writer(topology.is_coordinator, rank=topology.rank, use_collectives=True)
            try:
                results = writer.write_data(job.plan, job.planner).wait()
            except BaseException as exc:  # DCP's CheckpointException derives from BaseException
                if not _stopped(exc):
                    raise
                results = None
            if results is None:
                stack.close()  # this rank lets go of the partial directory: it is removable now
                _stopped_writing(job, round_, stats)
                return stats
            files = fs.finish(results)
            stats.write_s = time.perf_counter() - t0
            report = commit_files.RankReport(topology.rank, files, results, stats.write_s)
            if not topology.is_leader:
                _report_to_leader(job, round_, report, stats)
                return stats
            _lead_node(job, round_, report, stats, stack)
    except StoreUnavailable as exc:
        # No decision could be read: this attempt is over here, but a part already committed on
        # this node stays (undecided) if the coordinator may have decided it. Restore settles it:
        # the decision found on another node is written back, a part nobody decided is removed.
        _abandon(job, stats, f"the coordination store is unreachable ({exc})", [], [])
        _clean_up(job, round_, quiet=True, keep_committed_part=True)
    finally:
        stats.store_ops = job.store.ops - ops_before
    return stats


def _stop_when_abandoned(round_: CommitRound) -> Callable[[], bool]:
    """For the writer: past the deadline, at most every half second, whether the attempt has been
    decided abandoned (a rank still writing then is a straggler whose bytes nobody will commit)."""
    asked = [0.0]

    def stop() -> bool:
        now = time.monotonic()
        if not round_.past_deadline() or now - asked[0] < 0.5:
            return False
        asked[0] = now
        try:
            decision = round_.decision_if_made()
        except StoreUnavailable:
            return False  # no answer is no permission to drop the write
        return decision is not None and decision.outcome == DecisionOutcome.ABANDONED

    return stop


def _stopped(exc: BaseException) -> bool:
    """Whether ``exc`` (or what DCP wrapped in it) is the writer stopping on an abandoned attempt."""
    if isinstance(exc, SaveAbandoned):
        return True
    failures = getattr(exc, "failures", None) or {}
    inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return any(isinstance(e, SaveAbandoned) for e in [exc.__cause__, exc.__context__, *inner])


def _stopped_writing(job: SaveJob, round_: CommitRound, stats: SaveStats) -> None:
    """This rank stopped writing an attempt already decided abandoned: its rank is free at once (the
    next save is not skipped for a slow disk's sake); a leader acknowledges the decision and removes
    what its node wrote."""
    stats.outcome = SaveOutcome.ABANDONED
    stats.total_s = time.monotonic() - job.started
    log.warning(
        "step %d: rank %d stopped writing: the checkpoint was abandoned while it wrote (%.1f s after "
        "the save began)",
        job.step,
        job.topology.rank,
        stats.total_s,
    )
    if job.topology.is_leader:
        if job.topology.node_count > 1:
            _acknowledge(job, round_)
        _clean_up(job, round_)


def _report_to_leader(
    job: SaveJob, round_: CommitRound, report: commit_files.RankReport, stats: SaveStats
) -> None:
    # A rank finishing after the deadline asks first: if the checkpoint is already abandoned, its
    # report would only be a key nobody reads (its leader removes the files once it lets go).
    if round_.past_deadline():
        decision = round_.decision_if_made()
        if decision is not None and decision.outcome == DecisionOutcome.ABANDONED:
            stats.outcome = SaveOutcome.ABANDONED
            stats.total_s = time.monotonic() - job.started
            log.warning(
                "step %d: rank %d finished after the checkpoint was abandoned", job.step, job.topology.rank
            )
            return
    round_.publish_report(report.to_json())
    stats.outcome = SaveOutcome.WRITTEN
    stats.total_s = time.monotonic() - job.started


def _lead_node(
    job: SaveJob, round_: CommitRound, own: commit_files.RankReport, stats: SaveStats, locks: ExitStack
) -> None:
    topology = job.topology
    t0 = time.perf_counter()
    job.on_phase("waiting")
    others, missing = round_.collect_node()
    reports = {own.rank: own, **{r: commit_files.RankReport.from_json(body) for r, body in others.items()}}
    if missing or round_.past_deadline():
        late = missing or list(topology.node_ranks)
        where = topology.describe_node(topology.node)
        reason = f"{_ranks_text(late)} of {where} missed the {job.deadline_s:g} s deadline"
        if topology.node_count == 1:
            _abandon(job, stats, reason, [topology.node], late)
            round_.decide(Decision(DecisionOutcome.ABANDONED, reason, [topology.node], late))
        else:
            round_.publish_part({"node": topology.node, "missing_ranks": late})
            if topology.is_coordinator:
                _decide(job, round_, {}, stats)  # abandons, naming every node that missed the deadline
            _follow(job, round_, stats, part_committed=False)
        locks.close()
        _clean_up(job, round_)
        if topology.node_count == 1 and not layout.someone_writes(job.partial_dir):
            # Every rank has let go: nobody reads the abandoned decision any more. A straggler still
            # writing reads it when it finishes (and reports nothing); the next save forgets it.
            round_.forget_round()
        stats.finalize_s = time.perf_counter() - t0
        return
    if topology.node_count == 1:
        _commit_single_node(job, reports, stats)
        locks.close()
    else:
        record = commit_files.part_record(job.run, job.step, job.save_id, topology, reports)
        if not commit_files.commit_part(job.partial_dir, job.final_dir, record):
            raise commit_files.FinalizeError(
                f"{job.final_dir} already holds a committed checkpoint of step {job.step}"
            )
        locks.close()
        job.on_phase("part committed")
        round_.publish_part(
            {"node": topology.node, "reports": {r: rep.to_json() for r, rep in reports.items()}}
        )
        if topology.is_coordinator:
            _decide(job, round_, reports, stats)
        _follow(job, round_, stats, part_committed=True)
        if stats.outcome != SaveOutcome.COMMITTED:
            _clean_up(job, round_)
    stats.finalize_s = time.perf_counter() - t0


def _decide(
    job: SaveJob, round_: CommitRound, own_reports: dict[int, commit_files.RankReport], stats: SaveStats
) -> None:
    """The coordinator: every node's part by the deadline -> committed, else abandoned."""
    topology = job.topology
    parts, absent = round_.collect_parts()
    arrived = time.perf_counter()
    reports = dict(own_reports)
    late_nodes, late_ranks = list(absent), [r for k in absent for r in topology.nodes[k]]
    if not own_reports:
        late_nodes.insert(0, topology.node)
    for node, part in sorted(parts.items()):
        if "missing_ranks" in part:
            late_nodes.append(node)
            late_ranks.extend(part["missing_ranks"])
        else:
            reports.update(
                {int(r): commit_files.RankReport.from_json(body) for r, body in part["reports"].items()}
            )
    if not own_reports:
        late_ranks = list(topology.node_ranks) + late_ranks  # the coordinator's own node was late
    if late_nodes or round_.past_deadline():
        late_nodes = sorted(set(late_nodes)) or [topology.node]
        late_ranks = sorted(set(late_ranks)) or list(topology.node_ranks)
        names = "; ".join(topology.describe_node(k) for k in late_nodes)
        reason = f"{names} missed the {job.deadline_s:g} s deadline (ranks {late_ranks})"
        round_.decide(Decision(DecisionOutcome.ABANDONED, reason, late_nodes, late_ranks))
        return
    metadata, manifest = _build(job, reports)
    job.on_phase("deciding")
    round_.decide(
        Decision(
            DecisionOutcome.COMMITTED,
            body={"metadata": metadata.hex(), "manifest": manifest.to_json().decode()},
        )
    )
    stats.decision_s = time.perf_counter() - arrived
    stats.checkpoint_bytes = manifest.total_bytes


def _follow(job: SaveJob, round_: CommitRound, stats: SaveStats, part_committed: bool) -> None:
    """Every leader: make the decision durable on this node, or take the part back.

    The decision is the round's one compare-and-set value (:meth:`CommitRound.await_decision`), so
    every leader acts on the coordinator's outcome. Once a committed decision is durable on this
    node nothing can undo it: a store that fails afterwards (acknowledgements) is logged, and the
    coordinator still records the commit and announces it."""
    decision = round_.await_decision()
    topology = job.topology
    if decision.outcome == DecisionOutcome.COMMITTED and part_committed:
        metadata = bytes.fromhex(decision.body["metadata"])
        manifest_json = decision.body["manifest"].encode()
        job.on_phase("manifest")
        commit_files.write_decision(job.final_dir, metadata, manifest_json)
        stats.outcome = SaveOutcome.COMMITTED
        stats.total_s = time.monotonic() - job.started
        if not topology.is_coordinator:
            _acknowledge(job, round_)
            return
        # The staged event starts every node's promotion: first every node should hold the manifest.
        others = [k for k in range(topology.node_count) if k != topology.node]
        try:
            unconfirmed = round_.await_acks(others)
        except StoreUnavailable as exc:
            log.warning("step %d committed; the store is gone, acknowledgements unknown: %s", job.step, exc)
            unconfirmed = others
        if unconfirmed:
            log.warning(
                "step %d committed, but %s did not confirm writing the decision; restore repairs it",
                job.step,
                "; ".join(topology.describe_node(k) for k in unconfirmed),
            )
        _acknowledge(job, round_)
        after_commit(job, stats, manifest_json)
        return
    _acknowledge(job, round_)
    _abandon(job, stats, decision.reason or "abandoned", decision.missing_nodes, decision.missing_ranks)


def _acknowledge(job: SaveJob, round_: CommitRound) -> None:
    """Acknowledge the decision; a store that fails now changes nothing (the decision is read and
    acted on): it is logged, and the round's keys go with the store."""
    try:
        round_.acknowledge()
    except StoreUnavailable as exc:
        log.warning("step %d: could not acknowledge the decision (%s); it stands", job.step, exc)


def _commit_single_node(job: SaveJob, reports: dict[int, commit_files.RankReport], stats: SaveStats) -> None:
    t0 = time.perf_counter()
    metadata, manifest = _build(job, reports)
    stats.decision_s = time.perf_counter() - t0
    if not commit_files.commit(job.partial_dir, job.final_dir, metadata, manifest, job.on_phase):
        stats.outcome = SaveOutcome.DUPLICATE
        log.warning("step %d was already committed by another save; this copy was discarded", job.step)
        if job.catalog is not None:  # this attempt's row must not stay "writing" for good
            reason = f"duplicate: step {job.step} was already committed by another save"
            job.catalog.call("record_abandoned", job.run, job.step, job.save_id, reason)
        return
    stats.outcome = SaveOutcome.COMMITTED
    stats.total_s = time.monotonic() - job.started
    stats.checkpoint_bytes = manifest.total_bytes
    after_commit(job, stats, manifest.to_json())


def _build(job: SaveJob, reports: dict[int, commit_files.RankReport]) -> tuple[bytes, Manifest]:
    assert job.metadata is not None, "only the coordinator builds the checkpoint's .metadata"
    metadata, alternates = commit_files.metadata_bytes(job.metadata, reports)
    write_s = max(r.write_s for r in reports.values())
    manifest = commit_files.build_manifest(
        run=job.run,
        step=job.step,
        save_id=job.save_id,
        topology=job.topology,
        reports=reports,
        metadata=metadata,
        alternates=alternates,
        metrics=job.metrics,
        versions=versions(),
        stats={"stage_s": round(job.stats.stage_s, 6), "write_s": round(write_s, 6)},
    )
    return metadata, manifest


def _abandon(job: SaveJob, stats: SaveStats, reason: str, nodes: list[int], ranks: list[int]) -> None:
    stats.outcome = SaveOutcome.ABANDONED
    stats.missing_nodes, stats.missing_ranks = list(nodes), list(ranks)
    stats.total_s = time.monotonic() - job.started
    if job.topology.is_coordinator:
        log.warning("checkpoint step %d ABANDONED: %s; training continues", job.step, reason)
        if job.catalog is not None:
            job.catalog.call("record_abandoned", job.run, job.step, job.save_id, reason)
    else:
        log.warning(
            "step %d abandoned on %s: %s", job.step, job.topology.describe_node(job.topology.node), reason
        )


def _clean_up(
    job: SaveJob, round_: CommitRound, quiet: bool = False, keep_committed_part: bool = False
) -> None:
    """A leader removes this node's files of an abandoned attempt that no rank writes any more.

    A straggler still writing is not waited for: its rank stays busy, so at most the next save is
    skipped, and the leader's next save removes what it left (:func:`..save.room.remove_abandoned_partials`)
    once it let go. A dead writer's lock is gone with its process."""
    if not job.topology.is_leader:
        return
    if not layout.someone_writes(job.partial_dir):
        commit_files.discard(job.partial_dir)
    record = commit_files.read_part(job.final_dir)
    if (
        not keep_committed_part
        and record is not None
        and record.get("save_id") == job.save_id
        and not (job.final_dir / MANIFEST_NAME).exists()
    ):
        commit_files.discard(job.final_dir)
    elif keep_committed_part and record is not None and record.get("save_id") == job.save_id:
        log.warning(
            "step %d: this node's committed part is kept undecided (%s): the next restore writes the "
            "decision back if the coordinator made one, and removes the part if nobody did",
            job.step,
            job.final_dir,
        )
    try:
        round_.forget_node_reports()
    except StoreUnavailable:
        if not quiet:
            log.warning("step %d: could not delete this node's report keys (store unreachable)", job.step)


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
