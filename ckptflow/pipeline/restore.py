"""Plain functions behind ``ckptflow restore``: a checkpoint from the hottest tier that delivers it.

Only bytes move. Each tier's ``fetch`` checks every file against the manifest's CRC64NVME while it
reads it and publishes the directory by rename; the published copy is then read once more and
checked again. Nothing is unpickled. The target is never inside a tier's root (where live
checkpoints are) and an existing ``DIR/step-N`` is never overwritten.

Order of attempts: steps newest first (or just ``step``), and for each step the tiers hottest first
(or just the one asked for). Any failure (a corrupt file, an unreachable endpoint, a copy that does
not verify) is recorded with its reason and the next attempt follows.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckptflow.pipeline.tiers import load
from ckptflow.policy.config import TIER_ORDER, CkptflowConfig, PosixTierConfig
from ckptflow.storage import layout
from ckptflow.storage.tier import Progress, Tier
from ckptflow.storage.verify import verify_checkpoint

AUTO = "auto"
FAILED_VERIFY_MARK = ".failed-verify-"

# bar(description, total_bytes) -> a context manager giving the Progress callback (or None).
BarFactory = Callable[[str, int], AbstractContextManager[Progress | None]]


class RestoreRefused(ValueError):
    """The restore would write somewhere it must not; nothing was written."""


class RestoreFailed(RuntimeError):
    """No tier delivered a copy that verified; ``attempts`` says what each one did."""

    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        super().__init__(message)
        self.attempts = attempts


@dataclass(frozen=True)
class Attempt:
    """One try of one tier (or a listing that failed, ``step`` None)."""

    tier: str
    step: int | None
    uri: str
    ok: bool
    detail: str = ""
    bytes: int = 0
    seconds: float = 0.0
    then: str = ""  # what is tried next after a failure ("cold", "warm step 90"), "" if nothing
    absent: bool = False  # the tier holds no committed copy (not a failure of the copy it holds)

    def describe(self) -> str:
        what = f"step {self.step}" if self.step is not None else "listing"
        if self.ok:
            return f"{self.tier}: {what}: fetched {self.bytes} bytes in {self.seconds:.2f} s from {self.uri}"
        fallback = f"; falling back to {self.then}" if self.then else ""
        if self.absent:
            return f"{self.tier}: {what}: {self.detail}{fallback}"
        return f"{self.tier}: {what}: FAILED: {self.detail}{fallback}"


@dataclass
class RestoreResult:
    """What was restored, from where, and how fast."""

    run: str
    step: int
    tier: str
    source_uri: str
    path: Path
    files: int
    bytes: int
    fetch_seconds: float
    verify_seconds: float
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def fetch_mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.fetch_seconds if self.fetch_seconds > 0 else 0.0

    @property
    def verify_mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.verify_seconds if self.verify_seconds > 0 else 0.0


def _no_bar(_description: str, _total: int) -> AbstractContextManager[Progress | None]:
    return nullcontext(None)


def posix_roots(config: CkptflowConfig) -> dict[str, Path]:
    """The root directory of every POSIX tier in the config, by tier name."""
    return {name: Path(cfg.root) for name, cfg in config.tiers.items() if isinstance(cfg, PosixTierConfig)}


def refuse_unsafe_target(to: Path, roots: dict[str, Path]) -> None:
    """RestoreRefused if ``to`` is (inside) a tier root or is not a directory."""
    target = to.resolve()
    for name, root in roots.items():
        if target.is_relative_to(root.resolve()):
            raise RestoreRefused(
                f"--to {to} is inside the {name} tier's root {root}: restore never writes where live "
                "checkpoints are; choose a directory outside every tier root"
            )
    if to.exists() and not to.is_dir():
        raise RestoreRefused(f"--to {to} exists and is not a directory")


def _refuse_existing(dest: Path) -> None:
    if dest.exists() or dest.is_symlink():
        raise RestoreRefused(
            f"{dest} already exists; restore never overwrites: remove it or choose another --to"
        )


def tiers_to_try(tiers: dict[str, Tier], choice: str) -> list[Tier]:
    """The tiers for ``--tier``: every configured one hottest first (auto), or the one named."""
    if choice == AUTO:
        return [tiers[name] for name in TIER_ORDER if name in tiers]
    if choice not in tiers:
        raise RestoreRefused(
            f"--tier {choice}: no such tier in the config (configured: {', '.join(tiers)}; or auto)"
        )
    return [tiers[choice]]


def _listed_steps(order: list[Tier], run: str, note: Callable[[Attempt], None]) -> dict[str, set[int]]:
    """Committed steps of ``run`` per tier; a tier that cannot be listed is noted and left out."""
    listed: dict[str, set[int]] = {}
    for tier in order:
        try:
            listed[tier.name] = set(tier.list_steps(run))
        except Exception as exc:  # any failure: the next tier may still deliver
            note(Attempt(tier.name, None, "", False, f"cannot list run {run!r}: {_why(exc)}"))
    return listed


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _move_aside(dest: Path) -> Path:
    """A published copy that failed its re-verification is kept for inspection, out of the way."""
    aside = dest.with_name(f"{dest.name}{FAILED_VERIFY_MARK}{secrets.token_hex(4)}")
    dest.rename(aside)
    return aside


def _try_tier(
    tier: Tier, run: str, step: int, dest: Path, bar: BarFactory
) -> tuple[Attempt, RestoreResult | None]:
    uri = tier.uri(run, step)
    try:
        manifest = tier.read_manifest(run, step)
        if manifest is None:
            return Attempt(tier.name, step, uri, False, "no committed copy here", absent=True), None
        with bar(f"{tier.name} step-{step}", manifest.total_bytes) as progress:
            fetched = tier.fetch(run, step, dest, progress)
    except Exception as exc:  # any failure: the next tier may still deliver (fetch left nothing behind)
        return Attempt(tier.name, step, uri, False, _why(exc)), None
    start = time.perf_counter()
    try:
        with bar(f"verify step-{step}", manifest.total_bytes) as progress:
            report = verify_checkpoint(dest, progress=progress)
        found = report.manifest
        if found is not None and (found.run, found.step) != (run, step):
            problem = f"its manifest is of run {found.run!r} step {found.step}"
        else:
            problem = "; ".join(str(p) for p in report.problems) if not report.ok else ""
    except Exception as exc:
        problem = _why(exc)
    verify_s = time.perf_counter() - start
    if problem:
        aside = _move_aside(dest)
        return Attempt(
            tier.name, step, uri, False, f"fetched copy failed re-verification: {problem} (kept at {aside})"
        ), None
    attempt = Attempt(tier.name, step, uri, True, bytes=fetched.bytes, seconds=fetched.seconds)
    result = RestoreResult(
        run, step, tier.name, uri, dest, len(manifest.files), manifest.total_bytes, fetched.seconds, verify_s
    )
    return attempt, result


def restore_from_tiers(
    tiers: dict[str, Tier],
    run: str,
    to: Path,
    *,
    step: int | None = None,
    choice: str = AUTO,
    roots: dict[str, Path] | None = None,
    bar: BarFactory = _no_bar,
    report: Callable[[Attempt], None] | None = None,
) -> RestoreResult:
    """Fetch (run, step) (default: the newest that verifies) into ``to/step-N``; see the module doc.

    ``roots``: directories restore must never write into (the POSIX tiers' roots). ``report`` is
    called with every attempt as it ends, so a caller can say why it falls back before the next one.
    Raises RestoreRefused (nothing written) or RestoreFailed (every attempt failed).
    """
    refuse_unsafe_target(to, roots or {})
    order = tiers_to_try(tiers, choice)
    attempts: list[Attempt] = []

    def note(attempt: Attempt) -> None:
        attempts.append(attempt)
        if report is not None:
            report(attempt)

    if step is not None:
        _refuse_existing(to / layout.committed_name(step))
        plan = [(step, tier) for tier in order]
    else:
        listed = _listed_steps(order, run, note)
        steps = sorted(set().union(*listed.values()), reverse=True)
        plan = [(s, tier) for s in steps for tier in order if s in listed.get(tier.name, set())]
    for i, (candidate, tier) in enumerate(plan):
        dest = to / layout.committed_name(candidate)
        _refuse_existing(dest)
        attempt, result = _try_tier(tier, run, candidate, dest, bar)
        if i + 1 < len(plan) and not attempt.ok:
            next_step, next_tier = plan[i + 1]
            attempt = replace(
                attempt, then=next_tier.name + (f" step {next_step}" if next_step != candidate else "")
            )
        note(attempt)
        if result is not None:
            result.attempts = attempts
            return result
    steps = sorted({s for s, _ in plan}, reverse=True)
    names = ", ".join(t.name for t in order)
    if not steps:
        raise RestoreFailed(f"run {run!r} has no committed checkpoint on {names}", attempts)
    what = f"step {step}" if step is not None else f"any of steps {', '.join(map(str, steps))}"
    raise RestoreFailed(f"no tier ({names}) delivered a verified copy of run {run!r} {what}", attempts)


def restore(
    config_path: str,
    run: str,
    to: Path,
    *,
    step: int | None = None,
    choice: str = AUTO,
    bar: BarFactory = _no_bar,
    report: Callable[[Attempt], None] | None = None,
) -> RestoreResult:
    """:func:`restore_from_tiers` with the tiers (and the roots to keep out of) of ``ckptflow.yaml``."""
    config, tiers = load(config_path)
    return restore_from_tiers(
        tiers, run, to, step=step, choice=choice, roots=posix_roots(config), bar=bar, report=report
    )
