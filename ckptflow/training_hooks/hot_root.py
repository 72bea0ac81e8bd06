"""What ``Checkpointer(run, root)``'s root means: the hot tier's root, with the run appended.

One meaning of "root" everywhere: ckptflow.yaml's ``tiers.hot.root``, ``PosixTier``, the node's agent
and the Checkpointer all take the tier's root and keep a run's checkpoints in ``<root>/<run>/``. A
root that is itself a run's directory (the meaning before the layout issue: it holds ``step-N`` or
partial directories itself, and no ``<run>/``) is refused with the fix, never used: checkpoints
written to ``<root>/<run>/`` would be where the agent never looks, beside the ones it holds. Only
what the directory holds is judged, not its name: a tier root may be named like a run
(``tiers.hot.root: /nvme/llm`` with run ``llm``).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from ckptflow.storage import layout


def run_directory(root: Path, run: str) -> Path:
    """``root / run``, created and writable; ``ValueError`` naming ``Checkpointer.root`` and the fix
    when ``root`` looks like a run's own directory or cannot be written."""
    run_dir = root / run
    if root.is_dir() and not run_dir.exists() and _holds_steps(root):
        fix = f"move its step-N directories into {run_dir}"
        if root.name == run:
            fix += f", or pass root={root.parent}"
        raise ValueError(
            f"Checkpointer.root: {root} looks like the run's own directory (it holds checkpoints "
            f"directly): {fix}. root is the hot tier's root and the Checkpointer appends the run, as "
            "ckptflow.yaml's tiers.hot.root and the node's agent do"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".ckptflow-probe-{secrets.token_hex(4)}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"Checkpointer.root: cannot create or write {run_dir} ({exc.strerror}); "
            "pass a writable directory (the hot tier, e.g. node-local NVMe)"
        ) from exc
    return run_dir


def _holds_steps(directory: Path) -> bool:
    """Whether ``directory`` holds checkpoints of a run itself (``step-N`` or a partial of one)."""
    return any(e.kind in ("committed", "incomplete", "partial") for e in layout.scan(directory))
