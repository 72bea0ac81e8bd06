"""The recovery-drill spec (``drill.yaml``): which checkpoint to restore, from where, and what "passed" means.

```yaml
name: tiny-nightly              # names the drill in the catalog, artifacts and events
run: tiny                       # the training run whose checkpoints are drilled
checkpoint: latest              # latest | random | a step number (e.g. 200)
tier: cold                      # the tier to restore from (default cold: what a disaster leaves)
world_size: 1                   # ranks of the scratch job; may differ from training's (resharding)
eval: train_tiny:drill_eval     # module:function, see below
eval_kwargs: {hidden: 64}       # keyword arguments for the function (numbers, strings, booleans)
python_path: [../examples]      # directories put on the scratch job's sys.path (relative to this file)
metric: eval_loss               # the checkpoint metric recorded at save time to compare against
tolerance: 1.0e-6               # |drill loss - reference| allowed
rto: 10m                        # time-to-recover objective: drill start -> loss computed
job_timeout: 30m                # the scratch job is killed (its whole process group) after this
history_window: 1               # drills of this run the history quality gate looks at (newest first)
config: ckptflow.yaml           # optional; `ckptflow drill run --config` overrides it
scratch_dir: /scratch/drills    # optional; default: the system temp directory
```

The eval entry point is ``function(restore, **eval_kwargs) -> float``: it builds the model (and
whatever else the run checkpoints, e.g. the optimizer), calls ``restore(state)`` with a dict of
Stateful objects exactly as the training script does (the same restore path users use; it returns the
restored step), and returns the loss on a fixed batch: the value the training side recorded in the
checkpoint's metrics under ``metric`` (see ``examples/train_tiny.py``: ``drill_eval``).

Durations are a whole number and one unit: ``30s``, ``10m``, ``2h``. Paths are relative to the spec file.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from ckptflow.policy.yaml_source import ConfigError, load_yaml, validate

_SECONDS = re.compile(r"^([0-9]+)(s|m|h)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
_ENTRY_POINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def _duration(value: Any) -> Any:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, str) and (match := _SECONDS.match(value.strip())):
        return timedelta(seconds=int(match.group(1)) * _UNIT_S[match.group(2)])
    raise PydanticCustomError(
        "duration_format", "must be a duration: a whole number and one unit, e.g. 90s, 10m or 2h"
    )


def _positive(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise PydanticCustomError("duration_positive", "must be longer than zero, e.g. 10m")
    return value


def _entry_point(value: str) -> str:
    if not _ENTRY_POINT.match(value):
        raise PydanticCustomError(
            "entry_point",
            "'{value}' is not an entry point; write module:function, e.g. train_tiny:drill_eval",
            {"value": value},
        )
    return value


def _name(value: str) -> str:
    if not _NAME.match(value):
        raise PydanticCustomError(
            "name", "must be 1-100 letters, digits, '_', '.' or '-' (it names events and artifacts)"
        )
    return value


def _step_or_choice(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise PydanticCustomError("checkpoint", "a step number is 0 or more")
        return value
    if value in ("latest", "random"):
        return value
    raise PydanticCustomError(
        "checkpoint", "must be latest, random or a step number, got {value!r}", {"value": value}
    )


PositiveDuration = Annotated[timedelta, BeforeValidator(_duration), AfterValidator(_positive)]
EvalValue = bool | int | float | str


class DrillSpec(BaseModel):
    """One validated drill spec (see the module docstring for every field)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: Annotated[str, AfterValidator(_name)]
    run: str = Field(min_length=1)
    checkpoint: Annotated[Literal["latest", "random"] | int, BeforeValidator(_step_or_choice)] = "latest"
    tier: Literal["hot", "warm", "cold"] = "cold"
    world_size: int = Field(default=1, ge=1, le=64)
    eval: Annotated[str, AfterValidator(_entry_point)]
    eval_kwargs: dict[str, EvalValue] = Field(default_factory=dict)
    python_path: list[str] = Field(default_factory=list)
    metric: str = Field(default="eval_loss", min_length=1)
    tolerance: float = Field(ge=0, allow_inf_nan=False)
    rto: PositiveDuration
    job_timeout: PositiveDuration = timedelta(minutes=30)
    history_window: int = Field(default=1, ge=1, le=1000)
    seed: int | None = None  # for checkpoint: random (None: a different choice each drill)
    config: str | None = None
    scratch_dir: str | None = None

    @property
    def rto_s(self) -> float:
        return self.rto.total_seconds()

    @property
    def job_timeout_s(self) -> float:
        return self.job_timeout.total_seconds()


def load_drill_spec(path: str | Path) -> DrillSpec:
    """Load and validate a drill spec; relative paths in it are made absolute against its directory.

    Raises ConfigError naming the file, line and field on bad input.
    """
    spec: DrillSpec = validate(DrillSpec, load_yaml(path), str(path))
    base = Path(path).resolve().parent

    def absolute(p: str) -> str:
        return str((base / p).resolve())

    if spec.job_timeout < spec.rto:
        raise ConfigError(
            f"{path}: field 'job_timeout': {spec.job_timeout} is shorter than rto {spec.rto}; the job "
            "must be allowed at least the objective"
        )
    return spec.model_copy(
        update={
            "python_path": [absolute(p) for p in spec.python_path],
            "config": absolute(spec.config) if spec.config else None,
            "scratch_dir": absolute(spec.scratch_dir) if spec.scratch_dir else None,
        }
    )
