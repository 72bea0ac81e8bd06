"""Request signing (HMAC-SHA256, secret never sent, replay and clock-skew refused) and the token
bucket that caps replication bandwidth."""

from __future__ import annotations

import pickle

import pytest

from ckptflow.peer.auth import PeerSecret, Verifier, authorization, printable
from ckptflow.peer.bandwidth import TokenBucket
from ckptflow.policy.replication import ReplicationSecretError

SECRET = "peer-secret-Never-Printed-0123456789"
TARGET = "/v1/replicas/run-1/5/part-1-of-2/files/__2_0.distcp"
HOST = "node-a:8470"
HEADERS = {
    "host": HOST,
    "x-ckptflow-size": "10",
    "x-ckptflow-crc64nvme": "AAAAAAAAAAA=",
    "x-ckptflow-manifest": "00ff",
}


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_signed_request_verifies_once_and_carries_no_secret() -> None:
    secret = PeerSecret(SECRET)
    clock = Clock()
    verifier = Verifier(PeerSecret(SECRET), [HOST], clock=clock, not_before=0)
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
        ("PUT", TARGET, {**HEADERS, "host": "node-b:8470"}),
    ],
)
def test_a_signature_covers_method_path_query_and_transport_headers(
    method: str, target: str, headers: dict[str, str]
) -> None:
    clock = Clock()
    header = authorization(PeerSecret(SECRET), "PUT", TARGET, HEADERS, now=clock.now)
    reason = Verifier(PeerSecret(SECRET), [HOST], clock=clock, not_before=0).check(
        header, method, target, headers
    )
    assert reason is not None and "does not match this server's replication secret" in reason


def test_wrong_missing_or_malformed_credentials_are_refused_without_echoing_anything() -> None:
    clock = Clock()
    verifier = Verifier(PeerSecret(SECRET), [HOST], clock=clock, not_before=0)
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
    header = authorization(PeerSecret(SECRET), "GET", TARGET, {"host": HOST}, now=clock.now - 301)
    reason = Verifier(PeerSecret(SECRET), [HOST], clock=clock, not_before=0).check(
        header, "GET", TARGET, {"host": HOST}
    )
    assert reason is not None and "301 s away" in reason and "NTP" in reason


def test_a_request_signed_for_another_peer_is_refused_even_with_a_fresh_nonce() -> None:
    """A request captured on its way to node A and replayed to node B: B has never seen its nonce,
    but the signed Host names A."""
    clock = Clock()
    header = authorization(PeerSecret(SECRET), "DELETE", TARGET, HEADERS, now=clock.now)
    peer_b = Verifier(PeerSecret(SECRET), ["node-b:8470"], clock=clock, not_before=0)
    reason = peer_b.check(header, "DELETE", TARGET, HEADERS)
    assert reason is not None and "signed for node-a:8470, which is not this server" in reason
    # Node A accepts it, under its name or the local address its connection arrived at.
    assert (
        Verifier(PeerSecret(SECRET), ["NODE-A:8470"], clock=clock, not_before=0).check(
            header, "DELETE", TARGET, HEADERS
        )
        is None
    )
    on_ip = {**HEADERS, "host": "10.1.0.7:8470"}
    header = authorization(PeerSecret(SECRET), "DELETE", TARGET, on_ip, now=clock.now)
    assert peer_b.check(header, "DELETE", TARGET, on_ip, local="10.1.0.7:8470") is None


def test_a_request_signed_before_the_server_started_is_refused_after_a_restart() -> None:
    """Nonces live in memory: a server restarted within the skew window would take a request
    captured before the restart again, but for the window that starts at its start."""
    clock = Clock()
    first = Verifier(PeerSecret(SECRET), [HOST], clock=clock)
    clock.now += 5
    captured = authorization(PeerSecret(SECRET), "DELETE", TARGET, HEADERS, now=clock.now)
    assert first.check(captured, "DELETE", TARGET, HEADERS) is None
    clock.now += 0.01
    restarted = Verifier(PeerSecret(SECRET), [HOST], clock=clock)  # the agent came back
    reason = restarted.check(captured, "DELETE", TARGET, HEADERS)
    assert reason is not None and "before this server started" in reason
    # A client re-signs with the time the server names (it holds the secret): accepted.
    fresh = authorization(
        PeerSecret(SECRET), "DELETE", TARGET, HEADERS, now=clock.now, not_before=restarted.not_before
    )
    assert restarted.check(fresh, "DELETE", TARGET, HEADERS) is None


def test_a_request_of_the_previous_scheme_is_named_as_such() -> None:
    verifier = Verifier(PeerSecret(SECRET), [HOST], clock=Clock(), not_before=0)
    reason = verifier.check("Ckptflow-HMAC-SHA256 1:2:3", "GET", TARGET, HEADERS)
    assert reason is not None and "older ckptflow version" in reason


def test_log_text_from_the_network_cannot_forge_a_line() -> None:
    forged = "/v1/health\n2026-12-03 ckptflow.peer INFO peer replica deleted: everything"
    shown = printable(forged)
    assert "\n" not in shown and "\\n2026" in shown  # one line, the newline visible as \n
    assert printable("x" * 1000).endswith("...") and len(printable("x" * 1000)) == 203


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
