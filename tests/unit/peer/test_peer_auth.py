"""Request signing (HMAC-SHA256, secret never sent, replay and clock-skew refused) and the token
bucket that caps replication bandwidth."""

from __future__ import annotations

import pickle

import pytest

from ckptflow.peer.auth import PeerSecret, Verifier, authorization
from ckptflow.peer.bandwidth import TokenBucket
from ckptflow.policy.replication import ReplicationSecretError

SECRET = "peer-secret-Never-Printed-0123456789"
TARGET = "/v1/replicas/run-1/5/part-1-of-2/files/__2_0.distcp"
HEADERS = {"x-ckptflow-size": "10", "x-ckptflow-crc64nvme": "AAAAAAAAAAA=", "x-ckptflow-manifest": "00ff"}


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_signed_request_verifies_once_and_carries_no_secret() -> None:
    secret = PeerSecret(SECRET)
    clock = Clock()
    verifier = Verifier(PeerSecret(SECRET), clock=clock)
    header = authorization(secret, "PUT", TARGET, HEADERS, now=clock.now)
    assert SECRET not in header
    assert verifier.check(header, "PUT", TARGET, HEADERS) is None
    assert "replayed" in (verifier.check(header, "PUT", TARGET, HEADERS) or "")


@pytest.mark.parametrize(
    ("method", "target", "headers"),
    [
        ("DELETE", TARGET, HEADERS),
        ("PUT", TARGET.replace("part-1", "part-0"), HEADERS),
        ("PUT", TARGET, {**HEADERS, "x-ckptflow-crc64nvme": "AAAAAAAAAAE="}),
        ("PUT", TARGET, {**HEADERS, "x-ckptflow-size": "11"}),
        ("PUT", TARGET + "?run=x", HEADERS),
    ],
)
def test_a_signature_covers_method_path_query_and_transport_headers(
    method: str, target: str, headers: dict[str, str]
) -> None:
    clock = Clock()
    header = authorization(PeerSecret(SECRET), "PUT", TARGET, HEADERS, now=clock.now)
    reason = Verifier(PeerSecret(SECRET), clock=clock).check(header, method, target, headers)
    assert reason is not None and "does not match this server's replication secret" in reason


def test_wrong_missing_or_malformed_credentials_are_refused_without_echoing_anything() -> None:
    clock = Clock()
    verifier = Verifier(PeerSecret(SECRET), clock=clock)
    wrong = authorization(
        PeerSecret("another-secret-of-the-right-len"), "PUT", TARGET, HEADERS, now=clock.now
    )
    reasons = [
        verifier.check(wrong, "PUT", TARGET, HEADERS),
        verifier.check(None, "PUT", TARGET, HEADERS),
        verifier.check(f"Bearer {SECRET}", "PUT", TARGET, HEADERS),
        verifier.check("Ckptflow-HMAC-SHA256 1:2", "PUT", TARGET, HEADERS),
    ]
    assert all(r is not None for r in reasons)
    assert "no Authorization header" in reasons[1]  # type: ignore[operator]
    for reason in reasons:
        assert SECRET not in reason and wrong.split(":")[-1] not in reason  # type: ignore[operator]


def test_a_request_signed_too_far_from_the_servers_clock_is_refused() -> None:
    clock = Clock()
    header = authorization(PeerSecret(SECRET), "GET", TARGET, {}, now=clock.now - 301)
    reason = Verifier(PeerSecret(SECRET), clock=clock).check(header, "GET", TARGET, {})
    assert reason is not None and "301 s away" in reason and "NTP" in reason


def test_the_secret_hides_itself() -> None:
    secret = PeerSecret(f"  {SECRET}\n")
    assert SECRET not in repr(secret) and SECRET not in str(secret) and SECRET not in f"{secret}"
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(secret)
    with pytest.raises(ReplicationSecretError, match="at least 16") as failure:
        PeerSecret("tooshort")
    assert "tooshort" not in str(failure.value)


def test_the_token_bucket_holds_the_rate_over_any_chunk_size() -> None:
    clock = Clock(0.0)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    bucket = TokenBucket(1_000_000, burst_bytes=100_000, clock=clock, sleep=sleep)
    for size in [300_000, 1, 50_000, 2_000_000, 10] * 4:
        bucket.take(size)
    sent = sum([300_000, 1, 50_000, 2_000_000, 10] * 4)
    assert clock.now == pytest.approx((sent - 100_000) / 1_000_000)  # the burst, then exactly the rate
    clock.now += 10.0  # idle: the bucket refills to its burst, not beyond
    before = clock.now
    bucket.take(100_000)
    assert clock.now == before
    bucket.take(100_000)
    assert clock.now == pytest.approx(before + 0.1)


def test_the_token_bucket_refuses_a_non_positive_rate() -> None:
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be > 0"):
        TokenBucket(0)
