"""Tasks of the recovery drill: thin wrappers over :mod:`ckptflow.pipeline.drill` and the gates.

No retries: a drill measures what happens on the first try; retrying would hide the failure it exists
to find.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptflow.catalog import Catalog
from ckptflow.pipeline import drill as drill_ops
from ckptflow.pipeline.tiers import load
from ckptflow.policy.drill_spec import DrillSpec
from ckptflow.tasks import emit


def _tier(config_path: str, name: str) -> Any:
    _, tiers = load(config_path)
    if name not in tiers:
        raise drill_ops.DrillFailure(
            "setup", f"the drill spec asks for tier {name!r}, but {config_path} defines only {sorted(tiers)}"
        )
    return tiers[name]


@task(name="drill-choose-checkpoint", cache_policy=NO_CACHE)
def choose_and_pin(
    config_path: str, spec: DrillSpec, holder: str, ttl_s: float
) -> drill_ops.ChosenCheckpoint:
    """The checkpoint to drill, pinned by ``holder`` for ``ttl_s`` (the caller unpins it)."""
    config, _ = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return drill_ops.choose_and_pin(catalog, _tier(config_path, spec.tier), spec, holder, ttl_s)
    finally:
        catalog.dispose()


@task(name="drill-fetch-and-verify", cache_policy=NO_CACHE)
def fetch_into_scratch(config_path: str, spec: DrillSpec, step: int, scratch: Path) -> drill_ops.Fetched:
    return drill_ops.fetch_into_scratch(_tier(config_path, spec.tier), spec, step, scratch)


@task(name="drill-scratch-job", cache_policy=NO_CACHE)
def run_scratch_job(spec: DrillSpec, step: int, scratch: Path) -> drill_ops.JobResult:
    return drill_ops.run_scratch_job(spec, step, scratch)


@task(name="drill-quality-gates", cache_policy=NO_CACHE)
def quality_gates(config_path: str, spec: DrillSpec) -> list[Any]:
    """The catalog suite (the drilled run) and the drill-history suite, with Great Expectations."""
    from ckptflow.pipeline.report import quality_gates as gates  # noqa: PLC0415 - GX costs seconds to import

    config, _ = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        policy = Path(config_path).resolve().parent / "retention.yaml"
        kept = gates.kept_checkpoint_ids(catalog, policy if policy.exists() else None)
        history = catalog.drills(spec.run, limit=spec.history_window)
        return [
            gates.run_catalog_gate(catalog, metric=spec.metric, kept_ids=kept, run=spec.run),
            gates.run_drill_history_gate(history),
        ]
    finally:
        catalog.dispose()


@task(name="drill-emit-verdict", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def emit_verdict(summary: dict[str, Any]) -> str:
    """Emit the drill's verdict (:func:`ckptflow.tasks.emit.drill_verdict`); its name."""
    return emit.drill_verdict(summary)
