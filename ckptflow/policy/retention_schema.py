"""``retention.yaml``: which checkpoint replicas each tier keeps, what storage costs, and the budgets.

```yaml
sdc_detection_window: 7d        # how late silent data corruption may be found (floor F4)
grace_period: 1d                # soft-delete -> purge delay (the apply flow, not the planner)
budget:
  monthly_usd: 5000.0           # overall, US dollars per month; omit the section for no overall budget
tiers:                          # hot, warm, cold; a tier left out is never touched by retention
  hot:
    price: {per_gb_month: 0.0}
    monthly_budget_usd: null    # optional per-tier budget
    delete_without_colder_copy: false
    rules:
      - keep_last: 2            # the run's N newest verified checkpoints
  cold:
    price: {per_gb_month: 0.004, min_storage_days: 90, put_per_1000: 0.02, delete_per_1000: 0.0}
    rules:
      - keep_every: 2000        # steps divisible by K
      - keep_within: 2d         # created no longer ago than this
      - keep_best: {metric: loss, n: 3, mode: min}
      - keep_tagged: [release, pinned]
```

Durations are strings with one unit: ``30m``, ``12h``, ``7d``, ``2w``. Money is a plain number of US
dollars: ``5k``, ``$5000`` and ``1e3`` (which YAML 1.1 reads as text) are refused with the fix.
What the rules and floors mean is documented in :mod:`ckptflow.policy.retention`, the planner.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ckptflow.policy.config import TIER_ORDER
from ckptflow.policy.yaml_source import load_yaml, validate

_DURATION = re.compile(r"^([0-9]+)(m|h|d|w)$")
_UNIT = {"m": timedelta(minutes=1), "h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}


def parse_duration(value: Any) -> Any:
    """``"7d"`` -> ``timedelta(days=7)``; a timedelta passes through; anything else is an error."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, str):
        if isinstance(value, int | float) and not isinstance(value, bool):
            raise PydanticCustomError(
                "duration_unit", "a bare number has no unit; write e.g. 7d (units: m, h, d, w)"
            )
        raise PydanticCustomError("duration_type", "must be a duration such as 30m, 12h, 7d or 2w")
    match = _DURATION.match(value.strip())
    if match is None:
        raise PydanticCustomError(
            "duration_format",
            "'{value}' is not a duration; write a whole number and one unit, e.g. 30m, 12h, 7d or 2w",
            {"value": value},
        )
    return int(match.group(1)) * _UNIT[match.group(2)]


def _dollars(value: Any) -> Any:
    """A plain number of US dollars; strings (``5k``, ``$5000``, ``1e3``) and booleans are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError(
            "usd",
            "must be a plain number of US dollars, e.g. 5000.0 (not '5k', '$5000' or '1e3': YAML reads "
            "1e3 as text, write 1000.0)",
        )
    if not math.isfinite(value):
        raise PydanticCustomError("usd", "must be a finite number of US dollars")
    return float(value)


def _positive(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise PydanticCustomError("duration_positive", "must be longer than zero, e.g. 2d")
    return value


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]
PositiveDuration = Annotated[timedelta, BeforeValidator(parse_duration), AfterValidator(_positive)]
Usd = Annotated[float, Field(ge=0), BeforeValidator(_dollars)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Price(_Strict):
    """List prices of one tier. ``put_per_1000`` is for promotion estimates; the planner does not use it."""

    per_gb_month: Usd
    min_storage_days: int = Field(default=0, ge=0, le=3650)
    put_per_1000: Usd = 0.0
    delete_per_1000: Usd = 0.0


class KeepLast(_Strict):
    keep_last: int = Field(ge=1)


class KeepEvery(_Strict):
    keep_every: int = Field(ge=1)


class KeepWithin(_Strict):
    keep_within: PositiveDuration


class BestSpec(_Strict):
    metric: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$", description="read from the column metric_<metric>")
    n: int = Field(default=1, ge=1)
    mode: Literal["min", "max"]


class KeepBest(_Strict):
    keep_best: BestSpec


class KeepTagged(_Strict):
    keep_tagged: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)


_RULE_KEYS = {
    "keep_last": "KeepLast",
    "keep_every": "KeepEvery",
    "keep_within": "KeepWithin",
    "keep_best": "KeepBest",
    "keep_tagged": "KeepTagged",
}


def _rule_tag(value: Any) -> str | None:
    if isinstance(value, dict) and len(value) == 1:
        return _RULE_KEYS.get(next(iter(value)))
    if isinstance(value, BaseModel):
        return type(value).__name__
    return None


RuleSpec = Annotated[
    Annotated[KeepLast, Tag("KeepLast")]
    | Annotated[KeepEvery, Tag("KeepEvery")]
    | Annotated[KeepWithin, Tag("KeepWithin")]
    | Annotated[KeepBest, Tag("KeepBest")]
    | Annotated[KeepTagged, Tag("KeepTagged")],
    Discriminator(
        _rule_tag,
        custom_error_type="retention_rule",
        custom_error_message=(
            "a rule is a mapping with exactly one key: keep_last: N, keep_every: K, keep_within: 7d, "
            "keep_best: {metric: loss, n: 3, mode: min} or keep_tagged: [release]"
        ),
    ),
]


class TierRetention(_Strict):
    price: Price
    monthly_budget_usd: Usd | None = None
    delete_without_colder_copy: bool = Field(
        default=False, description="lift floor F3 on this tier: delete even if no colder tier holds a copy"
    )
    rules: list[RuleSpec] = Field(description="required, even if empty: an empty list keeps only floors")


class Tiers(_Strict):
    hot: TierRetention | None = None
    warm: TierRetention | None = None
    cold: TierRetention | None = None

    @model_validator(mode="after")
    def _at_least_one(self) -> Tiers:
        if not self.items():
            raise PydanticCustomError("no_tiers", "configure at least one of hot, warm, cold")
        return self

    def items(self) -> list[tuple[str, TierRetention]]:
        """The configured tiers, hottest first."""
        return [(name, tier) for name in TIER_ORDER if (tier := getattr(self, name)) is not None]

    def get(self, name: str) -> TierRetention | None:
        return getattr(self, name, None) if name in TIER_ORDER else None


class Budget(_Strict):
    monthly_usd: Usd


class RetentionPolicy(_Strict):
    sdc_detection_window: Duration
    grace_period: Duration
    budget: Budget | None = None
    tiers: Tiers

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """Validate; an unknown key is reported before anything else.

        A misspelt key (``monthly_cents``) also leaves the intended one (``monthly_usd``) missing, and
        the misspelling, with its own line, is the error worth showing.
        """
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            unknown = [e for e in exc.errors() if e["type"] == "extra_forbidden"]
            if not unknown or unknown[0] is exc.errors()[0]:
                raise
            raise ValidationError.from_exception_data(
                exc.title,
                [{"type": "extra_forbidden", "loc": e["loc"], "input": e["input"]} for e in unknown],
            ) from None


def load_retention_policy(path: str | Path) -> RetentionPolicy:
    """Load and validate ``retention.yaml``; one ConfigError naming file, line and field otherwise."""
    return validate(RetentionPolicy, load_yaml(path), str(path))


def policy_hash(policy: RetentionPolicy) -> str:
    """sha256 of the policy's canonical JSON (defaults filled in, keys sorted): recorded with each plan."""
    canonical = json.dumps(policy.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
