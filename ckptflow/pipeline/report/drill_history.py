"""Drill history as a table and a plot: what ``ckptflow drill history`` prints and draws."""

from __future__ import annotations

from typing import Any

import pandas as pd

COLUMNS = [
    "id",
    "started_at",
    "spec_name",
    "run",
    "step",
    "tier",
    "saved_world_size",
    "world_size",
    "passed",
    "loss_delta",
    "tolerance",
    "rto_s",
    "rto_objective_s",
    "reason",
]


def history_frame(drills: list[Any]) -> pd.DataFrame:
    """One row per drill (oldest first) with the columns an operator reads."""
    rows = [{name: getattr(d, name) for name in COLUMNS} for d in drills]
    frame = pd.DataFrame(rows, columns=COLUMNS)
    return frame.sort_values(["started_at", "id"]).reset_index(drop=True)


def plot_history(frame: pd.DataFrame, path: str) -> str:
    """RTO and loss delta per drill over time, each against its objective; passed green, failed red."""
    import matplotlib  # noqa: PLC0415 - a plotting backend is only needed for --png

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_rto, ax_loss) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    colors = ["tab:green" if passed else "tab:red" for passed in frame["passed"]]
    when = pd.to_datetime(frame["started_at"], utc=True)
    ax_rto.scatter(when, frame["rto_s"].astype(float), c=colors, zorder=3)
    ax_rto.step(
        when, frame["rto_objective_s"].astype(float), where="post", color="gray", ls="--", label="objective"
    )
    ax_rto.set_ylabel("time to recover (s)")
    ax_rto.legend(loc="upper left")
    ax_loss.scatter(when, frame["loss_delta"].astype(float), c=colors, zorder=3)
    ax_loss.step(
        when, frame["tolerance"].astype(float), where="post", color="gray", ls="--", label="tolerance"
    )
    ax_loss.set_ylabel("|loss - reference|")
    ax_loss.set_yscale("symlog", linthresh=1e-9)
    ax_loss.legend(loc="upper left")
    ax_rto.set_title(f"Recovery drills: {int(frame['passed'].sum())} of {len(frame)} passed (red: failed)")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
