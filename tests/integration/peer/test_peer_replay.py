"""A captured request replayed: to another peer, and to the same peer after its agent restarted.
Two real servers on 127.0.0.1, a real replica, the request's bytes sent again as an eavesdropper
on the job's network would send them."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from peer_parts import RUN, SECRET, STEP, Checkpoint, make_checkpoint

from ckptflow.peer import PartId, PeerClient, PeerServer, push_part, replica_dir
from ckptflow.peer.auth import PeerSecret, authorization


@pytest.fixture
def ckpt() -> Checkpoint:
    return make_checkpoint(nodes=2, files_per_node=1, size=1 << 16)


def captured_delete(server: PeerServer) -> httpx.Request:
    """A DELETE of part 1's replica, signed for ``server`` exactly as a client signs it."""
    request = httpx.Request("DELETE", f"{server.url}/v1/replicas/{RUN}/{STEP}/part-1-of-2")
    target = request.url.raw_path.decode()
    request.headers["Authorization"] = authorization(PeerSecret(SECRET), "DELETE", target, request.headers)
    return request


def replay(request: httpx.Request, to: PeerServer) -> httpx.Response:
    """The captured request's method, path and headers (its Host and signature too) sent to ``to``."""
    again = httpx.Request(request.method, to.url + request.url.raw_path.decode(), headers=request.headers)
    with httpx.Client(trust_env=False) as raw:
        return raw.send(again)


def test_a_request_captured_for_one_peer_is_refused_by_another(tmp_path: Path, ckpt: Checkpoint) -> None:
    owner = ckpt.write_node(tmp_path / "owner-hot", 1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with PeerServer(tmp_path / "a", SECRET) as peer_a, PeerServer(tmp_path / "b", SECRET) as peer_b:
        push_part(owner, ckpt.manifest, 1, peer_b.url, SECRET)
        held_by_b = replica_dir(tmp_path / "b", RUN, STEP, PartId(1, 2))
        assert held_by_b.is_dir()

        request = captured_delete(peer_a)
        with httpx.Client(trust_env=False) as raw:
            assert raw.send(request).json() == {"deleted": False}  # A holds none: nothing to do
        refused = replay(request, peer_b)
        assert refused.status_code == 401
        assert f"signed for 127.0.0.1:{peer_a.port}, which is not this server" in refused.json()["error"]
        assert held_by_b.is_dir()  # B's good replica is still there
        with PeerClient(peer_b.url, SECRET) as client:  # and B still takes its own requests
            assert client.delete_replica(RUN, STEP, PartId(1, 2)) is True


def test_a_request_captured_before_a_restart_is_refused_after_it(tmp_path: Path, ckpt: Checkpoint) -> None:
    owner = ckpt.write_node(tmp_path / "owner-hot", 1)
    hot = tmp_path / "peer-hot"
    hot.mkdir()
    with PeerServer(hot, SECRET) as before:
        port = before.port
        push_part(owner, ckpt.manifest, 1, before.url, SECRET)
        request = captured_delete(before)  # signed, on the wire, but say it never arrived
    held = replica_dir(hot, RUN, STEP, PartId(1, 2))
    with PeerServer(hot, SECRET, port=port) as after:  # the agent restarted on the same address
        refused = replay(request, after)
        assert refused.status_code == 401 and "before this server started" in refused.json()["error"]
        assert held.is_dir()
        # A client whose clock lags the restarted server's re-signs with the time it names.
        with PeerClient(after.url, SECRET, retries=0) as client:
            client.signer.clock = lambda: time.time() - 5.0
            assert client.health()  # a GET, re-signed by the signer itself
            assert client.signer.not_before == after.not_before_ms
            client.signer.not_before = 0
            assert client.list_replicas(RUN)  # again after forgetting it
            client.signer.not_before = 0  # a streamed body the signer cannot re-send: request() does
            streamed = client.request("GET", "/v1/health", "health check", content=lambda: iter([b""]))
            assert streamed.json()["ok"] is True
