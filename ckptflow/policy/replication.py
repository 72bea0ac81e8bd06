"""The ``replication:`` section of ``ckptflow.yaml``: peer copies of each node's hot part.

```yaml
replication:
  factor: 2                 # copies of each part, its own included; default: 2 with >= 2 nodes, else 1
  jump: 8                   # peers of node n: n+J, n+2J, ... (mod nodes); J = nodes per failure domain
  bind_host: 10.1.0.7       # the interface the peer server listens on (default 127.0.0.1)
  port: 8470                # 0: any free port (the agent registers the address it got in the catalog)
  secret_file: /etc/ckptflow/secrets/replication   # shared by every node, mode 0600; or secret_env
  bandwidth_mib_s: 800      # cap on what one node sends, pushes and promote copies together (no cap)
```

``bandwidth_mib_s`` is one budget per node: every push to a peer and every promote-part copy from
the node's hot tier, in any process of the node, draws on it (``ckptflow.peer.node_budget``).

The secret itself never lives in this file: it comes from a file only its owner can read, or from
an environment variable, and every node of a job must hold the same one. It authenticates the
nodes to each other (``ckptflow.peer.auth``); it is never logged.
"""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ckptflow.policy.secret_file import read_secret_file

MIN_SECRET_CHARS = 16  # a guessable secret authenticates nobody; 32 random hex digits is the advice
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_ADVICE = (
    "create one with: python -c 'import secrets; print(secrets.token_hex(32))' > FILE && chmod 600 FILE"
)


class ReplicationSecretError(ValueError):
    """The replication secret cannot be used; the message names its source and the fix, never its value."""


class ReplicationConfig(BaseModel):
    """The ``replication:`` section (see the module docstring for an example)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    factor: int | None = Field(default=None, ge=1)
    jump: int = Field(default=1, ge=1)
    bind_host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8470, ge=0, le=65535)
    secret_file: str | None = Field(default=None, min_length=1)
    secret_env: str | None = Field(default=None, min_length=1)
    bandwidth_mib_s: float | None = Field(default=None, gt=0)
    timeout_s: float = Field(default=60.0, gt=0)
    retries: int = Field(default=3, ge=0, le=20)

    @field_validator("bandwidth_mib_s", "timeout_s", mode="before")
    @classmethod
    def _numbers_may_be_integers(cls, value: object) -> object:
        # Strict mode refuses an int for a float field; "bandwidth_mib_s: 800" is what people write.
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("secret_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not an environment variable name (letters, digits and '_', not starting "
                "with a digit); name the variable that holds the secret, not the secret itself"
            )
        return value

    @model_validator(mode="after")
    def _one_secret_source(self) -> ReplicationConfig:
        if self.secret_file is not None and self.secret_env is not None:
            raise ValueError("set secret_file or secret_env, not both (one source of the replication secret)")
        return self

    def effective_factor(self, node_count: int) -> int:
        """Copies of each part for a job of ``node_count`` nodes: ``factor``, else 2 with >= 2 nodes
        and 1 (no replication) on one node. ValueError naming ``replication.factor`` if the job
        has fewer nodes than copies asked for."""
        if node_count < 1:
            raise ValueError(f"node_count must be >= 1, got {node_count}")
        if self.factor is None:
            return 2 if node_count >= 2 else 1
        if self.factor > node_count:
            raise ValueError(
                f"replication.factor: {self.factor} copies of each part need {self.factor} nodes, but the "
                f"job has {node_count}; lower replication.factor to at most {node_count}"
            )
        return self.factor

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        return None if self.bandwidth_mib_s is None else self.bandwidth_mib_s * (1 << 20)

    def secret(self) -> str:
        """The shared replication secret, from ``secret_file`` (mode 0600 or 0400) or ``secret_env``.

        ReplicationSecretError (naming the source and the fix, never the value) if none is
        configured, it cannot be read, or it is shorter than ``MIN_SECRET_CHARS``.
        """
        if self.secret_file is not None:
            source = f"{os.path.expanduser(self.secret_file)} (replication.secret_file)"
            try:
                value = read_secret_file(self.secret_file, "replication secret")
            except ValueError as exc:
                raise ReplicationSecretError(f"replication.secret_file: {exc}") from None
        elif self.secret_env is not None:
            source = f"the environment variable {self.secret_env} (replication.secret_env)"
            value = os.environ.get(self.secret_env, "")
            if not value.strip():
                raise ReplicationSecretError(
                    f"replication.secret_env: {self.secret_env} is not set or empty; set it to the shared "
                    "replication secret on every node"
                )
        else:
            raise ReplicationSecretError(
                "replication: no secret configured; set replication.secret_file (a file only its owner "
                f"can read) or replication.secret_env, the same secret on every node ({SECRET_ADVICE})"
            )
        return check_secret(value, source)


def check_secret(value: str, source: str) -> str:
    """``value`` stripped, if long enough to be a secret; ReplicationSecretError naming ``source``."""
    stripped = value.strip()
    if len(stripped) < MIN_SECRET_CHARS:
        raise ReplicationSecretError(
            f"{source}: the replication secret has {len(stripped)} characters; at least "
            f"{MIN_SECRET_CHARS} are required ({SECRET_ADVICE})"
        )
    return stripped
