"""Which tiers a checkpoint is promoted to: the policy's rules asked per tier, one checkpoint at a
time (tier_admission) and for a run in save order (admitted_in_order, what `ckptflow plan` uses)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ckptflow.policy.admission import admitted_in_order, tier_admission
from ckptflow.policy.retention_rules import BestN, CheckpointInfo, EveryNSteps, LastN, Tagged, Within
from ckptflow.policy.retention_schema import RetentionPolicy

NOW = datetime(2026, 3, 1, tzinfo=UTC)
POLICY = RetentionPolicy.model_validate(
    {
        "sdc_detection_window": "7d",
        "grace_period": "1d",
        "tiers": {
            "warm": {"price": {"per_gb_month": 0.03}, "rules": [{"keep_last": 2}]},
            "cold": {
                "price": {"per_gb_month": 0.004, "min_storage_days": 90},
                "rules": [{"keep_every": 4}, {"keep_tagged": ["release"]}],
            },
        },
    }
)


def _infos(*steps: int, tags: dict[int, str] | None = None) -> list[CheckpointInfo]:
    return [
        CheckpointInfo(
            "r", s, NOW - timedelta(hours=10 - s), frozenset([tags[s]] if tags and s in tags else [])
        )
        for s in steps
    ]


def test_cold_takes_every_4th_tagged_or_pinned_and_says_why_it_skips_the_rest() -> None:
    infos = _infos(1, 2, 3, 4, 5, tags={5: "release"})
    by_step = {i.step: i for i in infos}
    decided = {s: tier_admission(POLICY, "cold", by_step[s], infos, NOW) for s in by_step}
    assert {s for s, a in decided.items() if a.keep} == {4, 5}
    assert decided[4].reason == "cold rule keep_every 4"
    assert decided[5].reason == "cold rule keep_tagged ['release']"
    assert (
        decided[3].reason
        == "no cold rule keeps it (keep_every 4, keep_tagged ['release']); promotion skips cold"
    )
    assert tier_admission(POLICY, "cold", by_step[3], infos, NOW, pinned=True).keep  # a drill's pin
    assert tier_admission(POLICY, "warm", by_step[5], infos, NOW).keep  # the newest: keep_last 2
    assert tier_admission(POLICY, "hot", by_step[3], infos, NOW).keep  # not in the policy
    assert tier_admission(None, "cold", by_step[3], infos, NOW).keep  # no policy at all


def test_in_save_order_each_rule_sees_the_checkpoint_as_the_newest() -> None:
    steps = [10, 20, 30, 40, 50, 60]
    loss = [5.0, 4.0, 4.5, 3.0, float("nan"), 3.0]
    assert admitted_in_order([EveryNSteps(20)], steps) == [False, True, False, True, False, True]
    assert admitted_in_order([LastN(1)], steps) == [True] * 6
    assert admitted_in_order([Within(timedelta(hours=1))], steps) == [True] * 6
    tags = [[], ["release"], [], [], [], []]
    assert admitted_in_order([Tagged(frozenset({"release"}))], steps, tags) == [
        False, True, False, False, False, False
    ]  # fmt: skip
    # The 2 lowest losses so far: 5.0 and 4.0 (the first two), 4.5 beats 5.0, 3.0 is the best, NaN is
    # never among them, and the second 3.0 ties the best one: a tie goes to the newer checkpoint.
    best = admitted_in_order([BestN("loss", 2, "min")], steps, metrics={"loss": loss})
    assert best == [True, True, True, True, False, True]
    loss_up = [1.0, 2.0, 3.0, 0.5, 4.0, 5.0]
    assert admitted_in_order([BestN("loss", 2, "min")], steps, metrics={"loss": loss_up}) == [
        True, True, False, True, False, False
    ]  # fmt: skip
