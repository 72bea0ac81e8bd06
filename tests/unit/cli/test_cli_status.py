"""``ckptflow status`` over a real SQLite catalog, recorded through the Catalog API.

Run "alpha": steps 100, 200, 300 committed (hot READY each). Step 100 is READY on warm and cold;
step 200's warm copy was deleted by retention (nothing owed) and it is READY on cold; step 300 is
being copied to warm and has no cold copy yet, and its staged event was never delivered. Its newest
drill failed. Run "beta": its only checkpoint turned out corrupt, so no tier holds a verified copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptflow.catalog import Catalog, Drill, ReplicaState
from ckptflow.catalog.engine import dispose_engine
from ckptflow.cli import app
from ckptflow.cli.status import _runs_table
from ckptflow.pipeline.report.cost import cost_now
from ckptflow.pipeline.report.status import StatusReport, default_policy_path, run_statuses, status_report

GB = 1_000_000_000
CHECKPOINT_BYTES = 2 * GB
TIERS = ["hot", "warm", "cold"]
PRICES = {"hot": 0.0, "warm": 0.03, "cold": 0.023}
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
POLICY = """\
sdc_detection_window: 7d
grace_period: 1d
budget:
  monthly_usd: {overall}
tiers:
  hot: {{price: {{per_gb_month: 0.0}}, rules: [{{keep_last: 2}}]}}
  warm: {{price: {{per_gb_month: 0.03}}, monthly_budget_usd: 1.0, rules: [{{keep_last: 6}}]}}
  cold: {{price: {{per_gb_month: 0.023}}, rules: [{{keep_last: 6}}]}}
"""


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Path]:
    """ckptflow.yaml with hot, warm (posix) and cold (s3, never contacted) tiers and an empty catalog."""
    path = tmp_path / "ckptflow.yaml"
    path.write_text(
        f"""\
catalog: sqlite:///{tmp_path / "catalog.db"}
tiers:
  hot: {{kind: posix, root: {tmp_path / "hot"}, price_per_gb_month: 0.0}}
  warm: {{kind: posix, root: {tmp_path / "warm"}, price_per_gb_month: 0.03}}
  cold: {{kind: s3, bucket: status-test, endpoint_url: "http://127.0.0.1:9", price_per_gb_month: 0.023}}
"""
    )
    yield path
    dispose_engine(Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}").url)


@pytest.fixture
def catalog(config: Path, tmp_path: Path) -> Catalog:
    cat = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    ids = {}
    for step in (100, 200, 300):
        ids[step] = cat.record_committed(
            "alpha",
            step,
            f"save-{step}",
            world_size=2,
            manifest_checksum="AAAAAAAAAAA=",
            bytes=CHECKPOINT_BYTES,
            file_count=2,
            metrics={"loss": 1.0},
            hot_uri=f"/hot/alpha/step-{step}",
            event_payload={},
        )
    for step, tier, state in (
        (100, "warm", ReplicaState.READY),
        (100, "cold", ReplicaState.READY),
        (200, "warm", ReplicaState.READY),
        (200, "warm", ReplicaState.DELETED),
        (200, "cold", ReplicaState.READY),
        (300, "warm", ReplicaState.COPYING),
    ):
        cat.set_replica_state(
            ids[step], tier, state, uri=f"{tier}://alpha/step-{step}", bytes=CHECKPOINT_BYTES
        )
    for event in cat.undelivered_events():
        if event.step != 300:
            cat.mark_delivered(event.id)  # type: ignore[arg-type]
    for minutes, passed, reason in ((0, True, None), (60, False, "loss delta 0.3 > tolerance 0.01")):
        at = T0 + timedelta(minutes=minutes)
        cat.record_drill(
            Drill(
                run="alpha",
                step=200,
                tier="cold",
                spec_name="small",
                world_size=1,
                tolerance=0.01,
                rto_objective_s=600.0,
                started_at=at,
                finished_at=at + timedelta(minutes=5),
                passed=passed,
                reason=reason,
            )
        )
    cat.record_committed(
        "beta",
        50,
        "save-50",
        world_size=1,
        manifest_checksum="AAAAAAAAAAA=",
        bytes=GB,
        file_count=1,
        metrics={},
        hot_uri="/hot/beta/step-50",
        event_payload={},
    )
    cat.mark_delivered(cat.undelivered_events()[-1].id)  # type: ignore[arg-type]
    cat.record_corrupt("beta", 50, "__0_0.distcp: checksum", "/hot/beta/quarantine/step-50.x")
    return cat


def _write_policy(config: Path, overall: float) -> Path:
    path = config.parent / "retention.yaml"
    path.write_text(POLICY.format(overall=overall))
    return path


def test_statuses_per_run(catalog: Catalog) -> None:
    alpha, beta = run_statuses(catalog, TIERS, PRICES)
    assert alpha.run == "alpha" and alpha.latest_committed == 300
    assert alpha.latest_ready == {"hot": 300, "warm": 100, "cold": 200}
    assert alpha.pending == {"warm": [300], "cold": [300]}  # step 200's deleted warm copy is not owed
    assert alpha.pending_promotions == 2 and alpha.undelivered_events == 1
    assert alpha.protected
    drill = alpha.last_drill
    assert drill is not None and drill.verdict == "failed" and drill.step == 200
    assert drill.reason == "loss delta 0.3 > tolerance 0.01" and drill.at == T0 + timedelta(minutes=65)
    # Held: hot x3 (free), warm 100 + 300 (copying holds bytes too), cold 100 + 200; warm 200 deleted.
    assert alpha.bytes_held == 7 * CHECKPOINT_BYTES
    assert alpha.usd_month == pytest.approx(2 * 2 * 0.03 + 2 * 2 * 0.023)

    assert beta.run == "beta" and beta.latest_committed is None
    assert beta.latest_ready == {"hot": None, "warm": None, "cold": None}
    assert not beta.protected and beta.pending == {} and beta.last_drill is None


def test_only_configured_tiers_are_reported_and_owed(catalog: Catalog) -> None:
    (alpha,) = run_statuses(catalog, ["hot", "cold"], {"hot": 0.0, "cold": 0.023}, run="alpha")
    assert alpha.latest_ready == {"hot": 300, "cold": 200}
    assert alpha.pending == {"cold": [300]}
    assert alpha.usd_month == pytest.approx(2 * 2 * 0.023)


def test_an_unknown_run_is_listed_unprotected(catalog: Catalog) -> None:
    (gamma,) = run_statuses(catalog, TIERS, PRICES, run="gamma")
    assert gamma.latest_committed is None and not gamma.protected and gamma.undelivered_events == 0


def test_report_costs_match_ckptflow_cost_and_the_policy_budget(config: Path, catalog: Catalog) -> None:
    assert default_policy_path(config) is None
    policy = _write_policy(config, overall=0.1)
    assert default_policy_path(config) == policy
    report = status_report(str(config))
    assert report.policy_path == str(policy) and report.budget_usd_month == 0.1
    assert [(c.tier, c.budget_usd_month) for c in report.tier_costs] == [
        ("hot", None),
        ("warm", 1.0),
        ("cold", None),
    ]
    total = sum(r["usd_month"] for r in cost_now(str(config)))
    assert report.usd_month == pytest.approx(total)
    assert sum(r.usd_month for r in report.runs) == pytest.approx(total)
    assert report.over_budget
    assert report.summary() == {
        "runs": "2",
        "unprotected": "1",
        "pending_promotions": "2",
        "undelivered_events": "1",
        "drills_failed": "1",
        "usd_month": "0.21",
        "budget_usd_month": "0.10",
        "over_budget": "true",
    }
    _write_policy(config, overall=100.0)
    assert not status_report(str(config)).over_budget


def test_the_unprotected_run_is_drawn_red(config: Path, catalog: Catalog) -> None:
    report = status_report(str(config))
    rows = _runs_table(report).rows
    assert [r.style for r in rows] == [None, "red"]


def _invoke(*args: str | Path) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})  # one line per row
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout, result.stderr


def test_the_status_command(config: Path, catalog: Catalog) -> None:
    _write_policy(config, overall=100.0)
    code, out, _ = _invoke("status", "--config", config)
    assert code == 0, out
    lines = out.splitlines()
    alpha = next(line for line in lines if line.startswith("│ alpha"))
    cells = [c.strip() for c in alpha.strip("│").split("│")]
    assert cells[:4] == ["alpha", "300", "300", "100"] and cells[4] == "200"
    assert cells[5] == "warm: 300; cold: 300; 1 undelivered event(s)"
    assert cells[6] == "failed step 200 cold, 2026-03-01 13:05 UTC: loss delta 0.3 > tolerance 0.01"
    assert cells[7] == "0.21"
    assert any(line.startswith("│ beta") for line in lines)
    assert "of a $100.00/month budget (0%): within budget" in out
    assert lines[-1] == (
        "runs=2 unprotected=1 pending_promotions=2 undelivered_events=1 drills_failed=1 "
        "usd_month=0.21 budget_usd_month=100.00 over_budget=false"
    )
    assert "\x1b[" not in out  # not a terminal: no colour codes, no progress bars


def test_status_of_one_run_without_a_policy(config: Path, catalog: Catalog) -> None:
    code, out, _ = _invoke("status", "--config", config, "--run", "beta")
    assert code == 0
    assert "alpha" not in out and "│ beta" in out
    assert "no budget (no retention policy" in out
    assert out.splitlines()[-1].startswith("runs=1 unprotected=1 pending_promotions=0 ")
    assert out.splitlines()[-1].endswith("budget_usd_month=none over_budget=false")


def test_an_empty_catalog(config: Path) -> None:
    code, out, _ = _invoke("status", "--config", config)
    assert code == 0
    assert "no checkpoints recorded" in out
    assert out.splitlines()[-1].startswith("runs=0 unprotected=0 ")


def test_bad_inputs_exit_2_with_one_line(config: Path, tmp_path: Path) -> None:
    code, _, err = _invoke("status", "--config", tmp_path / "nope.yaml")
    assert code == 2 and "does not exist" in err
    code, _, err = _invoke("status", "--config", config, "--policy", tmp_path / "nope.yaml")
    assert code == 2 and "retention policy" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("sdc_detection_window: 7d\n")
    code, _, err = _invoke("status", "--config", config, "--policy", bad)
    assert code == 2 and "bad.yaml" in err


def test_a_report_with_no_tier_costs_is_within_budget() -> None:
    assert not StatusReport(runs=[], tiers=["hot"]).over_budget


def test_status_shows_which_node_holds_which_part(config: Path, catalog: Catalog) -> None:
    catalog.record_parts(
        "alpha",
        300,
        [(0, "node0", "/hot/alpha/step-300", 10), (1, "node1", "/hot/alpha/step-300", 10)]
        + [(0, "node1", "node1:/hot/alpha/peers/part-0-of-2/step-300", 10)]
        + [(1, "node0", "node0:/hot/alpha/peers/part-1-of-2/step-300", 10)],
    )
    catalog.record_parts("alpha", 200, [(0, "node0", "/hot/alpha/step-200", 10)])
    catalog.record_parts("alpha", 200, [(1, "node1", "/hot/alpha/step-200", 10)], ReplicaState.LOST)
    code, out, _ = _invoke("status", "--config", config, "--run", "alpha")
    assert code == 0, out
    assert "parts on the nodes' own disks" in out
    rows = [line for line in out.splitlines() if "│ alpha" in line and ": node" in line]
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    assert cells == [["alpha", "300", "0: node0, node1; 1: node0, node1"]]  # step 200: one part, one node
