"""``S3Bucket.error``: a request refused for good (credentials rejected, access denied, no such
bucket) is a TierConfigurationError, anything else a plain TierError; scrub fails on the first kind
and calls the second "retry later". No server: the errors are botocore's own ClientError objects."""

from __future__ import annotations

from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from ckptflow.pipeline import scrub as scrub_ops
from ckptflow.pipeline.scrub import ScrubTarget
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.s3_client import S3Bucket, S3Credentials
from ckptflow.storage.tier import TierConfigurationError, TierError

SECRET = "s3cr3t-value"


def _client_error(code: str, status: int) -> ClientError:
    body = {
        "Error": {"Code": code, "Message": f"{code} says {SECRET}"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(body, "HeadObject")  # type: ignore[arg-type]


@pytest.fixture
def bucket() -> S3Bucket:
    return S3Bucket("cold", "ckpt", "http://127.0.0.1:1", credentials=S3Credentials("AKID", SECRET))


@pytest.mark.parametrize(
    ("code", "status", "says"),
    [
        ("InvalidAccessKeyId", 403, "the credentials were rejected"),
        ("SignatureDoesNotMatch", 403, "the credentials were rejected"),
        ("403", 403, "the credentials were rejected"),  # a rejected HEAD: no body, no code
        ("AccessDenied", 403, "access denied by"),
        ("NoSuchBucket", 404, "does not exist at"),
    ],
)
def test_a_request_refused_for_good_is_a_configuration_error(
    bucket: S3Bucket, code: str, status: int, says: str
) -> None:
    got = bucket.error(_client_error(code, status), "head_object", "runs/r/step-1/a")
    assert isinstance(got, TierConfigurationError) and says in str(got)
    assert SECRET not in str(got)


@pytest.mark.parametrize(("code", "status"), [("SlowDown", 503), ("InternalError", 500), ("NoSuchKey", 404)])
def test_anything_else_is_a_plain_tier_error(bucket: S3Bucket, code: str, status: int) -> None:
    got = bucket.error(_client_error(code, status), "head_object", "runs/r/step-1/a")
    assert type(got) is TierError and code in str(got)


class _Refusing(PosixTier):
    """A real POSIX tier whose verify raises ``error`` (what an S3 tier's verify raises)."""

    def __init__(self, root: Path, error: TierError) -> None:
        super().__init__("cold", root)
        self.error = error

    def verify(self, *args: object, **kwargs: object):  # type: ignore[override]
        raise self.error


def test_scrub_fails_on_a_configuration_error_and_retries_later_on_any_other(
    tmp_path: Path, bucket: S3Bucket
) -> None:
    target = ScrubTarget(checkpoint_id=1, run="r", step=1, tier="cold")
    denied = bucket.error(_client_error("AccessDenied", 403), "head_object")
    with pytest.raises(TierConfigurationError, match="access denied by"):
        scrub_ops.check_replica(_Refusing(tmp_path, denied), target)
    slow = bucket.error(_client_error("SlowDown", 503), "head_object")
    check = scrub_ops.check_replica(_Refusing(tmp_path, slow), target)
    assert check.verdict == scrub_ops.RETRY_LATER and "SlowDown" in check.problems[0]
