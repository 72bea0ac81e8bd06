"""``ckptflow.yaml``: the one config file of a deployment (catalog, tiers, Prefect), validated strictly.

```yaml
catalog: sqlite:////var/lib/ckptflow/catalog.db     # any SQLAlchemy URL; PostgreSQL at scale
prefect:
  api_url: http://127.0.0.1:4200/api                # never an ephemeral server on training ranks
  auth_string_file: /etc/ckptflow/secrets/prefect_auth_string   # optional: user:password, mode 0600
  emit_timeout_s: 5
  task_runner: threads                              # or: dask (prefect-dask; see PrefectConfig)
tiers:
  hot:  {kind: posix, root: /nvme/ckpt, price_per_gb_month: 0.0}
  warm: {kind: posix, root: /lustre/ckpt, price_per_gb_month: 0.03}
  cold:
    kind: s3
    bucket: training-checkpoints
    prefix: runs
    endpoint_url: https://s3.us-east-1.amazonaws.com   # omit for AWS defaults
    storage_class: STANDARD
    credentials_env: CKPTFLOW_S3_   # reads CKPTFLOW_S3_ACCESS_KEY_ID / _SECRET_ACCESS_KEY, else the AWS chain
    price_per_gb_month: 0.023
promote:
  workers: 8
  stale_upload_age_s: 3600
  lease_ttl_s: 120                                  # a dead writer's work is taken over after this
  catch_up_after_s: 60                              # a waited-for node without a run gets one this later
checkpoint:                                         # the Checkpointer's options (CheckpointOptions)
  deadline_s: 600
  on_busy: skip
replication:                                        # peer copies of hot parts (ckptflow.policy.replication)
  bind_host: 10.1.0.7
  secret_file: /etc/ckptflow/secrets/replication   # mode 0600, the same on every node
```
Secrets never live in this file: credentials come from the environment, the AWS chain or the 0600
files it names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ckptflow.policy.checkpoint_options import (
    CheckpointOptions,
    option_default,
    option_rule_broken,
    option_types,
)
from ckptflow.policy.replication import ReplicationConfig
from ckptflow.policy.secret_file import SecretFileError, read_secret_file
from ckptflow.policy.yaml_source import load_yaml, validate

TIER_ORDER = ("hot", "warm", "cold")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PosixTierConfig(_Strict):
    kind: Literal["posix"]
    root: str = Field(min_length=1)
    price_per_gb_month: float = Field(default=0.0, ge=0)
    workers: int = Field(default=8, ge=1, le=256)


class S3TierConfig(_Strict):
    kind: Literal["s3"]
    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    storage_class: str | None = None
    credentials_env: str | None = Field(
        default=None, description="prefix of <PREFIX>ACCESS_KEY_ID / <PREFIX>SECRET_ACCESS_KEY variables"
    )
    credentials_file: str | None = Field(
        default=None,
        description="JSON file with access_key_id/secret_access_key; refused unless mode 0600 or 0400",
    )
    price_per_gb_month: float = Field(default=0.023, ge=0)
    part_size_mib: int | None = Field(default=None, ge=5, le=5120)
    max_concurrency: int = Field(default=8, ge=1, le=256)


TierConfig = Annotated[PosixTierConfig | S3TierConfig, Field(discriminator="kind")]

# The CheckpointOptions that ckptflow.yaml holds outside its checkpoint: section, and where.
OPTIONS_OUTSIDE_THE_SECTION = {"event_timeout_s": "prefect.emit_timeout_s"}


def _option_in_yaml(name: str) -> Any:
    """``CheckpointOptions.<name>`` as a YAML field's type: pydantic checks the option's type strictly
    (an int is a valid float), then the option's own rule, reported in the dataclass's words."""

    def obey(value: Any) -> Any:
        broken = option_rule_broken(name, value)
        if broken is not None:
            raise PydanticCustomError("checkpoint_option", "{rule}", {"rule": broken})
        return value

    return Annotated[option_types()[name], AfterValidator(obey)]


_EmitTimeoutS = _option_in_yaml("event_timeout_s")


class PrefectConfig(_Strict):
    """The ``prefect:`` section.

    ``task_runner`` says where the promote and scrub flows run their per-batch tasks: ``threads``
    (default) in a thread pool of the flow-run process; ``dask`` on a Dask cluster through
    prefect-dask (``ckptflow.flows.runners``). ``dask_address`` (only with ``dask``) is the scheduler
    of a running cluster, e.g. ``tcp://10.0.0.5:8786``; its workers must see the same paths (this
    file, POSIX tiers) and reach the Prefect API and S3. Without it, every flow run starts and stops a
    temporary local cluster (about 10 s more per run on a 2-core machine).

    ``auth_string_file`` names a file holding the ``user:password`` of the server's basic auth
    (readable by its owner only); ckptflow's Prefect clients (the training side's staged event, the
    CLI's flow runs) send it unless ``PREFECT_API_AUTH_STRING`` is set. ``ckptflow services up``
    writes one.
    """

    api_url: str | None = None
    auth_string_file: str | None = Field(default=None, min_length=1)
    emit_timeout_s: _EmitTimeoutS = option_default("event_timeout_s")  # CheckpointOptions.event_timeout_s
    task_runner: Literal["threads", "dask"] = "threads"
    dask_address: str | None = Field(default=None, min_length=1)
    work_pool: str = "ckptflow"

    @field_validator("dask_address")
    @classmethod
    def _dask_address_needs_dask(cls, value: str | None, info: ValidationInfo) -> str | None:
        # task_runner is declared first, so it is in info.data unless it failed validation itself.
        if value is not None and info.data.get("task_runner", "dask") != "dask":
            raise ValueError(
                f"a Dask scheduler address is used only with task_runner: dask (task_runner is "
                f"{info.data['task_runner']!r}); set task_runner: dask, or remove dask_address"
            )
        return value

    def auth_string(self) -> str | None:
        """``PREFECT_API_AUTH_STRING`` if set, else the content of ``auth_string_file``, else None."""
        if os.environ.get("PREFECT_API_AUTH_STRING"):
            return os.environ["PREFECT_API_AUTH_STRING"]
        if self.auth_string_file is None:
            return None
        value = read_secret_file(self.auth_string_file, "Prefect auth string").strip()
        if not value:
            raise SecretFileError(f"{self.auth_string_file}: the Prefect auth string file is empty")
        return value


class PromoteConfig(_Strict):
    workers: int = Field(default=8, ge=1, le=256)
    stale_upload_age_s: float = Field(default=3600.0, ge=0)
    stale_partial_age_s: float = Field(default=3600.0, ge=0)
    # How long a writer's lease on a replica lives without a heartbeat (it beats every quarter of
    # this): how soon a crashed promotion's work can be resumed or cleaned by another.
    lease_ttl_s: float = Field(default=120.0, gt=0)
    # A node that copied its part and waits for a few others schedules, this long later, a
    # promote-part run on each of them that has none (its event-driven run was lost;
    # tasks/catch_up.py). 0: never.
    catch_up_after_s: float = Field(default=60.0, ge=0)


CheckpointConfig = create_model(
    "CheckpointConfig",
    __base__=_Strict,
    __module__=__name__,
    __doc__="""The ``checkpoint:`` section: the training side's settings, generated from
    :class:`ckptflow.policy.checkpoint_options.CheckpointOptions` (same names, types, defaults and
    rules; see its docstring), so the two cannot differ. The one option not here is
    ``event_timeout_s``: it bounds the post to the Prefect API, so it lives beside that API, as
    ``prefect.emit_timeout_s``.""",
    **{
        name: (_option_in_yaml(name), option_default(name))
        for name in CheckpointOptions.field_names()
        if name not in OPTIONS_OUTSIDE_THE_SECTION
    },
)


class CkptflowConfig(_Strict):
    catalog: str = Field(min_length=1)
    tiers: dict[Literal["hot", "warm", "cold"], TierConfig]
    prefect: PrefectConfig = PrefectConfig()
    promote: PromoteConfig = PromoteConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    replication: ReplicationConfig = ReplicationConfig()

    @model_validator(mode="after")
    def _hot_tier_required(self) -> CkptflowConfig:
        if "hot" not in self.tiers:
            raise ValueError("tiers.hot is required (where training writes checkpoints)")
        if self.tiers["hot"].kind != "posix":
            raise ValueError("tiers.hot must be kind: posix (the training side writes to a filesystem)")
        return self

    def checkpoint_options(self) -> CheckpointOptions:
        """The ``checkpoint:`` section with ``prefect.emit_timeout_s``: the Checkpointer's options."""
        return CheckpointOptions(**self.checkpoint.model_dump(), event_timeout_s=self.prefect.emit_timeout_s)

    def tier_names(self) -> list[str]:
        return [name for name in TIER_ORDER if name in self.tiers]

    def first_colder_tier(self) -> str:
        """The tier node parts are copied into (warm, or cold when there is no warm)."""
        colder = [t for t in self.tier_names() if t != "hot"]
        if not colder:
            raise ValueError(
                "ckptflow.yaml has no tier colder than hot to promote to (add tiers.warm or tiers.cold)"
            )
        return colder[0]


def load_config(path: str | Path) -> CkptflowConfig:
    """Load and validate ``ckptflow.yaml``; ConfigError naming file, line and field otherwise."""
    return validate(CkptflowConfig, load_yaml(path), str(path))
