"""`ckptflow retention plan --snapshot`: plan a saved catalog snapshot from the terminal."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ckptflow.cli import app

POLICY = """\
sdc_detection_window: 7d
grace_period: 1d
budget: {monthly_usd: 100.0}
tiers:
  warm:
    price: {per_gb_month: 0.03}
    rules:
      - keep_last: 2
"""


def test_plan_from_a_snapshot_prints_totals_per_tier(tmp_path: Path) -> None:
    policy = tmp_path / "retention.yaml"
    policy.write_text(POLICY)
    snapshot = tmp_path / "snapshot.jsonl"
    rows = [
        {
            "run": "r",
            "step": step,
            "tier": "warm",
            "bytes": 10**9,
            "created_at": f"2026-11-0{step}T00:00:00Z",
            "replica_state": "ready",
            "checkpoint_state": "verified",
            "tags": [],
            "pinned": False,
            "metric_loss": 1.0 / step,
        }
        for step in range(1, 6)
    ]
    snapshot.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(
        app,
        [
            "retention",
            "plan",
            "--policy",
            str(policy),
            "--snapshot",
            str(snapshot),
            "--now",
            "2026-11-06T00:00:00+00:00",
        ],
    )
    assert result.exit_code == 0, result.output
    # 5 warm copies of 1 GB at $0.03: keep_last 2 keeps steps 4 and 5, and floor F4 keeps step 1
    # (the oldest checkpoint still inside the 7-day SDC window) -> 2 deletions, $0.15 -> $0.09.
    assert "total: 2 deletions" in result.output
    assert "$0.15/month -> $0.09/month" in result.output


def test_plan_needs_exactly_one_source(tmp_path: Path) -> None:
    policy = tmp_path / "retention.yaml"
    policy.write_text(POLICY)
    result = CliRunner().invoke(app, ["retention", "plan", "--policy", str(policy)])
    assert result.exit_code == 2
    assert "exactly one of --config" in result.output
