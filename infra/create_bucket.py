"""Create the bucket of every S3 tier in ``ckptflow.yaml`` if it does not exist yet (idempotent).

    python infra/create_bucket.py /etc/ckptflow/ckptflow.yaml

The compose stack runs it once before the worker starts (service ``s3-bucket``). Endpoint, region and
credentials are the tier's own (``credentials_env`` / ``credentials_file``, else boto3's chain), so a
bucket it can create is one the pipeline can use. Prints what it did; exits 1 naming the tier and the
bucket (never a key) when it cannot.
"""

from __future__ import annotations

import argparse
import sys

from ckptflow.policy.config import S3TierConfig, load_config
from ckptflow.policy.yaml_source import ConfigError
from ckptflow.storage.from_config import build_tier
from ckptflow.storage.s3_client import error_code
from ckptflow.storage.s3_tier import S3Tier
from ckptflow.storage.tier import TierError

ALREADY_THERE = frozenset({"BucketAlreadyOwnedByYou", "BucketAlreadyExists"})


def ensure_bucket(tier: S3Tier) -> str:
    """``"exists"`` or ``"created"``; TierError (naming endpoint and bucket, never the secret) otherwise."""
    try:
        tier.s3.call("create_bucket")
    except TierError as exc:
        if error_code(exc) in ALREADY_THERE:
            return "exists"
        raise
    return "created"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="path to ckptflow.yaml")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"create_bucket: {exc}", file=sys.stderr)
        return 2
    status = 0
    for name in config.tier_names():
        tier_config = config.tiers[name]
        if not isinstance(tier_config, S3TierConfig):
            continue
        tier = build_tier(name, tier_config)
        assert isinstance(tier, S3Tier)
        try:
            print(f"{name}: bucket {tier.bucket!r} at {tier.endpoint}: {ensure_bucket(tier)}")
        except TierError as exc:
            print(f"create_bucket: {exc}", file=sys.stderr)
            status = 1
        finally:
            tier.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
