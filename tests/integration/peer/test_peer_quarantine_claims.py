"""A fetcher's "this file is corrupt" is a claim the holder checks on its own copy before it moves
anything aside: a byte flipped on the wire (or in the fetcher's memory) must not cost a good
replica, nor, when the replica is gone, the holder's own part. A real server on 127.0.0.1; the flip
is made by the fetcher's HTTP transport, as a faulty NIC or DIMM on the fetching node would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from peer_parts import RUN, SECRET, STEP, Checkpoint, make_checkpoint, tree

from ckptflow.peer import (
    PartId,
    PeerClient,
    PeerCorrupt,
    PeerRefused,
    PeerServer,
    push_part,
    replica_dir,
    replica_entries,
)


class _Flipped(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, at: int) -> None:
        self.inner, self.at = inner, at

    def __iter__(self) -> Iterator[bytes]:
        seen = 0
        for chunk in self.inner:
            if seen <= self.at < seen + len(chunk):
                flipped = bytearray(chunk)
                flipped[self.at - seen] ^= 0x04
                chunk = bytes(flipped)
            seen += len(chunk)
            yield chunk

    def close(self) -> None:
        self.inner.close()


class FlipOneByte(httpx.BaseTransport):
    """The fetcher's side of the wire: flips one bit of the body of every GET of ``path``."""

    def __init__(self, path: str, at: int = 4097) -> None:
        self.inner = httpx.HTTPTransport()
        self.path, self.at = path, at

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.method != "GET" or not request.url.path.endswith("/files/" + self.path):
            return response
        assert isinstance(response.stream, httpx.SyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Flipped(response.stream, self.at),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self.inner.close()


def flipping_client(url: str, path: str) -> PeerClient:
    client = PeerClient(url, SECRET, retries=0)
    client.http = httpx.Client(
        base_url=client.url, auth=client.signer, transport=FlipOneByte(path), trust_env=False
    )
    return client


@pytest.fixture
def ckpt() -> Checkpoint:
    return make_checkpoint(nodes=2, files_per_node=2, size=1 << 16)


def test_a_fetcher_that_flips_a_byte_does_not_get_a_good_replica_quarantined(
    tmp_path: Path, ckpt: Checkpoint
) -> None:
    hot = tmp_path / "peer-hot"
    hot.mkdir()
    owner = ckpt.write_node(tmp_path / "owner-hot", 1)
    entries = replica_entries(ckpt.manifest, 1)
    victim = entries[1].path
    with PeerServer(hot, SECRET) as server:
        push_part(owner, ckpt.manifest, 1, server.url, SECRET)
        replica = replica_dir(hot, RUN, STEP, PartId(1, 2))
        before = tree(hot)

        with flipping_client(server.url, victim) as client:
            with pytest.raises(PeerCorrupt) as failure:
                client.fetch_part(RUN, STEP, PartId(1, 2), entries, tmp_path / "fetched")
            assert failure.value.file == victim
            # What restore does next (training_hooks/restore/sources.py): ask for quarantine.
            with pytest.raises(PeerRefused) as refused:
                client.quarantine_replica(RUN, STEP, PartId(1, 2), f"restore: {failure.value}", victim)
        assert refused.value.status == 409
        assert "verifies against its manifest" in str(refused.value)
        assert tree(hot) == before and replica.is_dir()  # nothing moved, nothing written

        # Every file suspect (a client that names none): still read again, still good, still kept.
        with PeerClient(server.url, SECRET) as client:
            with pytest.raises(PeerRefused, match="verifies against its manifest"):
                client.quarantine_replica(RUN, STEP, PartId(1, 2), "said to be corrupt")
            fetched = client.fetch_part(RUN, STEP, PartId(1, 2), entries, tmp_path / "again")
        assert fetched.files == len(entries)
        assert (tmp_path / "again" / victim).read_bytes() == ckpt.data[victim]


def test_a_false_claim_never_costs_the_holders_own_part_and_a_true_one_still_quarantines(
    tmp_path: Path, ckpt: Checkpoint
) -> None:
    """With no peer replica (pruned), the served copy is the node's own part: the claim is checked
    on it just the same. A copy that really is damaged is still moved aside."""
    own_hot = tmp_path / "own-hot"
    own = ckpt.write_node(own_hot, 0)
    entries = replica_entries(ckpt.manifest, 0)
    victim = entries[0].path
    with PeerServer(own_hot, SECRET) as server:
        with flipping_client(server.url, victim) as client:
            with pytest.raises(PeerCorrupt) as failure:
                client.fetch_part(RUN, STEP, PartId(0, 2), entries, tmp_path / "fetched")
            with pytest.raises(PeerRefused, match="verifies against its manifest"):
                client.quarantine_replica(RUN, STEP, PartId(0, 2), str(failure.value), victim)
        assert (own / victim).read_bytes() == ckpt.data[victim]

        raw = bytearray((own / victim).read_bytes())
        raw[100] ^= 0x01  # now the holder's disk really is wrong
        (own / victim).write_bytes(bytes(raw))
        with PeerClient(server.url, SECRET) as client:
            moved = Path(client.quarantine_replica(RUN, STEP, PartId(0, 2), "restore: corrupt", victim))
        assert not own.exists() and (moved / victim).read_bytes() == bytes(raw)
        assert "verified here" in (moved / "QUARANTINE_REASON.txt").read_text()
