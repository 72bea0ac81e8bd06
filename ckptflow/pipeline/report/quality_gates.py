"""Great Expectations quality gates over the catalog and the drill history.

A recovery drill proves one checkpoint restores; these gates prove the catalog around it can be
trusted: every live checkpoint lists every file its manifest does, sizes and checksums are well
formed, each has a finite reference loss to compare a drill against, and every checkpoint retention
keeps has a verified copy somewhere. The drill-history gate checks past drills stayed within their
loss tolerance and recovery-time objective.

Plain functions, no Prefect. great_expectations (~6 s to import) and pandas are imported inside the
functions, and one ephemeral GX context is kept per process. A failure line names the checkpoints
(run and step) or drills that broke the expectation, so an operator knows where to look.

GX's own ``gx.Checkpoint`` class has nothing to do with training checkpoints and is not used here.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptflow.catalog import LIVE_STATES, ReplicaState

if TYPE_CHECKING:
    import pandas as pd

    from ckptflow.catalog import Catalog, Drill

__all__ = [
    "CHECKSUM_PATTERN",
    "GateResult",
    "catalog_frames",
    "kept_checkpoint_ids",
    "run_catalog_gate",
    "run_drill_history_gate",
]

# S3's form of a CRC64NVME: 8 bytes in base64 are 12 characters ending in one "="; the 11th encodes
# the last 4 bits followed by two zero bits, so it is one of 16 letters (what checksums.encode makes).
CHECKSUM_PATTERN = r"^[A-Za-z0-9+/]{10}[AEIMQUYcgkosw048]=$"
EXAMPLES = 5  # failing rows named per expectation

_QUOTED = frozenset({"checksum", "path"})  # string columns shown with quotes (empty or odd values)


@dataclass(frozen=True)
class GateResult:
    """The outcome of one gate: which expectations failed and on which checkpoints or drills."""

    suite: str  # "catalog" or "drill_history"
    success: bool
    evaluated: int  # expectations evaluated
    failures: list[str]  # one line per failed expectation

    def describe(self) -> str:
        """A summary line, then one indented line per failed expectation."""
        if self.success:
            return f"{self.suite} gate passed: all {self.evaluated} expectations met"
        lines = [
            f"{self.suite} gate FAILED: {len(self.failures)} of {self.evaluated} expectations not met",
            *(f"  - {failure}" for failure in self.failures),
        ]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Check:
    """One expectation, what it means in words, and the columns that show why a row failed."""

    expectation: Any  # a gx.expectations.Expectation
    says: str
    show: tuple[tuple[str, str], ...]  # (label, column) pairs


# --- frames ---------------------------------------------------------------------------------------


def _reference_loss(metrics: dict[str, Any] | None, metric: str) -> tuple[float, str]:
    """(the metric as a float, NaN unless present and finite; how it is recorded, in words)."""
    if not metrics or metric not in metrics:
        return math.nan, "missing"
    value = metrics[metric]
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return math.nan, f"not a number: {value!r}"
    try:
        number = float(value)
    except ValueError:
        return math.nan, f"not a number: {value!r}"
    return (number if math.isfinite(number) else math.nan), repr(number)


def catalog_frames(
    catalog: Catalog, metric: str = "eval_loss", kept_ids: set[int] | None = None, run: str | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(checkpoints frame, files frame) of the live (committed/verified) checkpoints of ``run`` (every
    run when None), by run and step.

    Checkpoints: ``checkpoint_id, run, step, state, file_count`` (the manifest's count, from the
    catalog row), ``files_listed`` (file rows the catalog lists), ``files_bytes`` (their total size),
    ``bytes`` (catalog row), ``reference_loss`` (``metrics[metric]``; NaN when missing or not finite),
    ``reference_loss_recorded`` (what is recorded, in words: "missing", "inf", ...), ``kept`` (in
    ``kept_ids``, or every live checkpoint when it is None), ``has_verified_replica`` (a READY replica
    on any tier). Files: ``checkpoint_id, run, step, path, bytes, checksum``.
    """
    import pandas as pd

    # Checkpoints first, then files: a file list is committed with its checkpoint, so every
    # checkpoint read here already has its files when they are read.
    live = sorted(
        (cp for cp in catalog.checkpoints(run) if cp.state in LIVE_STATES), key=lambda c: (c.run, c.step)
    )
    by_id = {cp.id: cp for cp in live}
    files = sorted(
        (f for f in catalog.all_files() if f.checkpoint_id in by_id),
        key=lambda f: (by_id[f.checkpoint_id].run, by_id[f.checkpoint_id].step, f.path),
    )
    listed: Counter[int] = Counter(f.checkpoint_id for f in files)
    listed_bytes: defaultdict[int, int] = defaultdict(int)
    for f in files:
        listed_bytes[f.checkpoint_id] += int(f.bytes)
    losses = [_reference_loss(cp.metrics, metric) for cp in live]
    ids = [int(cp.id) for cp in live]  # type: ignore[arg-type]
    checkpoints = pd.DataFrame(
        {
            "checkpoint_id": pd.Series(ids, dtype="int64"),
            "run": pd.Series([cp.run for cp in live], dtype="str"),
            "step": pd.Series([cp.step for cp in live], dtype="int64"),
            "state": pd.Series([cp.state.value for cp in live], dtype="str"),
            "file_count": pd.Series([cp.file_count for cp in live], dtype="int64"),
            "files_listed": pd.Series([listed[i] for i in ids], dtype="int64"),
            "files_bytes": pd.Series([listed_bytes[i] for i in ids], dtype="int64"),
            "bytes": pd.Series([cp.bytes for cp in live], dtype="int64"),
            "reference_loss": pd.Series([loss for loss, _ in losses], dtype="float64"),
            "reference_loss_recorded": pd.Series([text for _, text in losses], dtype="str"),
            "kept": pd.Series([kept_ids is None or i in kept_ids for i in ids], dtype="bool"),
            "has_verified_replica": pd.Series(
                [any(r.state == ReplicaState.READY for r in catalog.replicas(i)) for i in ids], dtype="bool"
            ),
        }
    )
    files_frame = pd.DataFrame(
        {
            "checkpoint_id": pd.Series([f.checkpoint_id for f in files], dtype="int64"),
            "run": pd.Series([by_id[f.checkpoint_id].run for f in files], dtype="str"),
            "step": pd.Series([by_id[f.checkpoint_id].step for f in files], dtype="int64"),
            "path": pd.Series([f.path for f in files], dtype="str"),
            "bytes": pd.Series([f.bytes for f in files], dtype="int64"),
            "checksum": pd.Series([f.checksum for f in files], dtype="str"),
        }
    )
    return checkpoints, files_frame


def _drill_frame(drills: Sequence[Drill]) -> pd.DataFrame:
    import pandas as pd

    def floats(name: str) -> pd.Series:
        return pd.Series([getattr(d, name) for d in drills], dtype="float64")  # None -> NaN

    return pd.DataFrame(
        {
            "drill_id": pd.Series([d.id for d in drills], dtype="object"),
            "run": pd.Series([d.run for d in drills], dtype="str"),
            "step": pd.Series([d.step for d in drills], dtype="object"),
            "tolerance": floats("tolerance"),
            "loss_delta": floats("loss_delta"),
            "rto_s": floats("rto_s"),
            "rto_objective_s": floats("rto_objective_s"),
            "passed": pd.Series([bool(d.passed) for d in drills], dtype="bool"),
            "reason": pd.Series([d.reason or "" for d in drills], dtype="str"),
        }
    )


# --- running expectations -------------------------------------------------------------------------

_GX_LOCK = threading.Lock()  # the cached context is not thread-safe
_GX: dict[str, Any] = {}  # "context", and one batch definition per asset name


def _batch_definition(asset: str) -> tuple[Any, Any]:
    """The process's ephemeral GX context and a whole-dataframe batch definition for ``asset``.

    Call with ``_GX_LOCK`` held.
    """
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = _GX.get("context")
    if context is None:
        context = gx.get_context(mode="ephemeral")
        # Progress bars would write to the stderr of every flow run.
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        _GX["context"] = context
        _GX["source"] = context.data_sources.add_pandas("ckptflow_quality_gates")
    key = f"batch:{asset}"
    if key not in _GX:
        _GX[key] = _GX["source"].add_dataframe_asset(asset).add_batch_definition_whole_dataframe(asset)
    return context, _GX[key]


def _value(column: str, value: Any) -> str:
    if isinstance(value, str):
        return repr(value) if column in _QUOTED else value
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else f"{value:g}"
    return str(value)


def _columns(kwargs: dict[str, Any]) -> str:
    if "column" in kwargs:
        return f"column {kwargs['column']}"
    return f"columns {kwargs.get('column_A')} and {kwargs.get('column_B')}"


def _validate(
    asset: str,
    frame: pd.DataFrame,
    checks: Sequence[_Check],
    noun: str,
    label: Callable[[pd.Series], str],
) -> tuple[bool, int, list[str]]:
    """Run ``checks`` over ``frame``; (success, expectations evaluated, one line per failure)."""
    import great_expectations as gx

    name = f"ckptflow_{asset}_{uuid.uuid4().hex[:12]}"
    expectations = []
    for i, check in enumerate(checks):
        check.expectation.meta = {"ckptflow_check": i}  # results come back in GX's order, not ours
        expectations.append(check.expectation)
    with _GX_LOCK:
        context, batch = _batch_definition(asset)
        suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
        try:
            validation = context.validation_definitions.add(
                gx.ValidationDefinition(data=batch, suite=suite, name=name)
            )
            try:
                result = validation.run(
                    batch_parameters={"dataframe": frame},
                    result_format={"result_format": "SUMMARY", "partial_unexpected_count": EXAMPLES},
                )
            finally:
                context.validation_definitions.delete(name)
        finally:
            context.suites.delete(name)

    failures: list[tuple[int, str]] = []
    for outcome in result.results:
        if outcome.success:
            continue
        config = outcome.expectation_config
        check = checks[int((config.meta or {})["ckptflow_check"])]
        head = f"{check.says} ({config.type}, {_columns(config.kwargs)})"
        info = outcome.exception_info or {}
        if info.get("raised_exception"):
            failures.append(
                (config.meta["ckptflow_check"], f"{head}: not evaluated: {info.get('exception_message')}")
            )
            continue
        counts = outcome.result or {}
        failed = int(counts.get("unexpected_count") or 0)
        examples = []
        for index in (counts.get("partial_unexpected_index_list") or [])[:EXAMPLES]:
            row = frame.loc[index]
            shown = ", ".join(
                f"{text}={_value(column, row[column])}"
                for text, column in check.show
                if column in _QUOTED or row[column] != ""  # an empty reason says nothing
            )
            examples.append(f"{label(row)} ({shown})" if shown else label(row))
        more = f"; and {failed - len(examples)} more" if failed > len(examples) else ""
        failures.append(
            (
                config.meta["ckptflow_check"],
                f"{head}: {failed} of {len(frame)} {noun} failed: {'; '.join(examples)}{more}",
            )
        )
    return bool(result.success), len(result.results), [text for _, text in sorted(failures)]


# --- the gates ------------------------------------------------------------------------------------


def _checkpoint_label(row: pd.Series) -> str:
    return f"run {row['run']} step {row['step']}"


def _file_label(row: pd.Series) -> str:
    return f"run {row['run']} step {row['step']} file {row['path']!r}"


def _drill_label(row: pd.Series) -> str:
    step = "no step" if row["step"] is None or row["step"] != row["step"] else f"step {row['step']}"
    return f"drill {row['drill_id']} (run {row['run']} {step})"


def run_catalog_gate(
    catalog: Catalog, metric: str = "eval_loss", kept_ids: set[int] | None = None, run: str | None = None
) -> GateResult:
    """Check the live checkpoints of ``run`` (every run when None); ``kept_ids`` None: all are kept.

    Every live checkpoint lists all its manifest files (count and total bytes), listed file sizes
    are positive, checksums have the base64 CRC64NVME form, ``metrics[metric]`` is present and
    finite, and every kept checkpoint has a verified (READY) replica on some tier.
    """
    import great_expectations as gx

    checkpoints, files = catalog_frames(catalog, metric, kept_ids, run)
    ex = gx.expectations
    checkpoint_checks = [
        _Check(
            ex.ExpectColumnPairValuesToBeEqual(column_A="files_listed", column_B="file_count"),
            "every live checkpoint lists all its manifest files",
            (("files listed", "files_listed"), ("manifest files", "file_count")),
        ),
        _Check(
            ex.ExpectColumnPairValuesToBeEqual(column_A="files_bytes", column_B="bytes"),
            "every live checkpoint's listed files add up to its manifest bytes",
            (("listed bytes", "files_bytes"), ("manifest bytes", "bytes")),
        ),
        _Check(
            # Non-finite losses are NaN in the frame, and GX counts NaN as null.
            ex.ExpectColumnValuesToNotBeNull(column="reference_loss"),
            f"every live checkpoint has a finite reference loss ({metric})",
            ((metric, "reference_loss_recorded"),),
        ),
        _Check(
            ex.ExpectColumnPairValuesToBeInSet(
                column_A="kept",
                column_B="has_verified_replica",
                value_pairs_set=[(True, True), (False, True), (False, False)],
            ),
            "every kept checkpoint has a verified (READY) replica on some tier",
            (("kept", "kept"), ("READY replica", "has_verified_replica")),
        ),
    ]
    file_checks = [
        _Check(
            ex.ExpectColumnValuesToBeBetween(column="bytes", min_value=0, strict_min=True),
            "every listed file has a positive size",
            (("bytes", "bytes"),),
        ),
        _Check(
            ex.ExpectColumnValuesToNotBeNull(column="checksum"),
            "every listed file has a checksum",
            (),
        ),
        _Check(
            ex.ExpectColumnValuesToMatchRegex(column="checksum", regex=CHECKSUM_PATTERN),
            "every listed file's checksum is a base64 CRC64NVME (12 characters ending in '=')",
            (("checksum", "checksum"),),
        ),
    ]
    ok_ck, n_ck, failed_ck = _validate(
        "checkpoints", checkpoints, checkpoint_checks, "live checkpoints", _checkpoint_label
    )
    ok_files, n_files, failed_files = _validate("files", files, file_checks, "listed files", _file_label)
    return GateResult(
        suite="catalog",
        success=ok_ck and ok_files,
        evaluated=n_ck + n_files,
        failures=failed_ck + failed_files,
    )


def run_drill_history_gate(drills: Sequence[Drill]) -> GateResult:
    """Check past drills: loss delta measured and within tolerance, RTO measured and within objective."""
    import great_expectations as gx

    ex = gx.expectations
    checks = [
        _Check(
            ex.ExpectColumnValuesToNotBeNull(column="loss_delta"),
            "every drill measured its loss delta",
            (("reason", "reason"),),
        ),
        _Check(
            # A missing delta is the not-null check's failure; counting it here would say it twice.
            ex.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="tolerance",
                column_B="loss_delta",
                or_equal=True,
                ignore_row_if="either_value_is_missing",
            ),
            "every drill's loss delta is within its tolerance",
            (("loss_delta", "loss_delta"), ("tolerance", "tolerance")),
        ),
        _Check(
            ex.ExpectColumnValuesToNotBeNull(column="rto_s"),
            "every drill measured its time to recover",
            (("reason", "reason"),),
        ),
        _Check(
            ex.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="rto_objective_s",
                column_B="rto_s",
                or_equal=True,
                ignore_row_if="either_value_is_missing",
            ),
            "every drill recovered within its RTO objective",
            (("rto_s", "rto_s"), ("objective_s", "rto_objective_s")),
        ),
    ]
    ok, evaluated, failures = _validate("drills", _drill_frame(drills), checks, "drills", _drill_label)
    return GateResult(suite="drill_history", success=ok, evaluated=evaluated, failures=failures)


# --- what retention keeps -------------------------------------------------------------------------


def kept_checkpoint_ids(
    catalog: Catalog, policy_path: str | Path | None, now: datetime | None = None
) -> set[int] | None:
    """Ids of the live checkpoints that retention keeps under the policy at ``policy_path``.

    A checkpoint is kept when at least one of its replicas (not already deleted) is not in the plan's
    deletions; a live checkpoint without replica rows is therefore not kept. None when no policy file
    is given or it does not exist: the caller then treats every live checkpoint as kept.
    """
    if policy_path is None or not Path(policy_path).is_file():
        return None
    from ckptflow.policy.retention import plan_retention
    from ckptflow.policy.retention_schema import load_retention_policy

    policy = load_retention_policy(policy_path)
    at = now or datetime.now(UTC)
    snapshot = catalog.retention_snapshot(at)
    live_values = [state.value for state in LIVE_STATES]
    live = snapshot[
        snapshot["checkpoint_state"].isin(live_values)
        & (snapshot["replica_state"] != ReplicaState.DELETED.value)
    ]
    if live.empty:
        return set()
    plan = plan_retention(snapshot, policy, at)
    doomed = {(d.run, int(d.step), d.tier) for d in plan.deletions}
    return {
        int(checkpoint_id)
        for run, step, tier, checkpoint_id in zip(
            live["run"], live["step"], live["tier"], live["checkpoint_id"], strict=True
        )
        if (run, int(step), tier) not in doomed
    }
