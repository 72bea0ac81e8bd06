"""Build storage tiers from the validated ``ckptflow.yaml`` models (policy.config).

Used by the pipeline's tasks and by the training side (``Checkpointer.from_config``) for restore
from colder tiers. boto3 is imported only when an S3 tier is built.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckptflow.policy.config import CkptflowConfig, PosixTierConfig, S3TierConfig
from ckptflow.policy.secret_file import read_secret_file
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.tier import Tier


def s3_credentials(cfg: S3TierConfig) -> object | None:
    """Credentials from the environment variables or secret file named in the config, else None
    (boto3's usual chain: env, profile, instance role). The config never holds a secret itself."""
    from ckptflow.storage.s3_tier import S3Credentials  # noqa: PLC0415 - boto3 stays lazy

    if cfg.credentials_env:
        found = S3Credentials.from_env(cfg.credentials_env)
        if found is not None:
            return found
    if cfg.credentials_file:
        path = Path(os.path.expanduser(cfg.credentials_file))
        text = read_secret_file(path, "S3 credentials")  # refused unless only its owner can read it
        try:
            body = json.loads(text)
            return S3Credentials(body["access_key_id"], body["secret_access_key"])
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(
                f"{path}: cannot read S3 credentials ({type(exc).__name__}); the file must be JSON with "
                "'access_key_id' and 'secret_access_key' (mode 0600)"
            ) from None
    return None


def build_tier(name: str, cfg: PosixTierConfig | S3TierConfig) -> Tier:
    if isinstance(cfg, PosixTierConfig):
        return PosixTier(name, cfg.root, workers=cfg.workers)
    from ckptflow.storage.s3_tier import S3Tier  # noqa: PLC0415

    return S3Tier(
        name=name,
        bucket=cfg.bucket,
        prefix=cfg.prefix,
        endpoint_url=cfg.endpoint_url,
        region=cfg.region,
        storage_class=cfg.storage_class,
        credentials=s3_credentials(cfg),  # type: ignore[arg-type]
        part_size=cfg.part_size_mib * (1 << 20) if cfg.part_size_mib else None,
        max_concurrency=cfg.max_concurrency,
    )


def build_tiers(config: CkptflowConfig) -> dict[str, Tier]:
    """Every configured tier, hottest first."""
    return {name: build_tier(name, config.tiers[name]) for name in config.tier_names()}
