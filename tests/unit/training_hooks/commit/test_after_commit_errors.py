"""Nothing after the commit fails a save, and every background failure is reported.

The Prefect endpoint is a real local socket server that answers the event POST with something
other than HTTP (an SSH banner, a TLS alert as a TLS port sends to a plaintext client), hangs up
mid-answer, or hangs up at once; the checkpoint stays committed, counted as committed, the error is
logged and counted, and ``close()`` does not raise. Failing writes (a disk error on every file)
make two saves fail: ``close()`` raises one error naming both.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptflow.catalog import Catalog, CheckpointState, ReplicaState
from ckptflow.training_hooks import Checkpointer, CheckpointOptions, CheckpointSaveError, ModelState
from ckptflow.training_hooks.commit.announce import EventPoster

ANSWERS = {
    # Something that is not an HTTP server listens on the port: http.client.BadStatusLine.
    "ssh banner": b"SSH-2.0-OpenSSH_9.6\r\n",
    # A TLS port answers a plaintext request with an alert record: BadStatusLine as well.
    "tls alert": b"\x15\x03\x03\x00\x02\x02\x32",
    # A status line and headers, then the connection drops inside the body: IncompleteRead.
    "hang-up mid-body": b'HTTP/1.1 200 OK\r\nContent-Length: 64\r\n\r\n{"ok',
    # The connection closes before any answer: RemoteDisconnected.
    "hang-up at once": b"",
}


class GarbageServer:
    """Accepts connections on 127.0.0.1, reads the request, answers ``answer`` and closes."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)  # accept() wakes up to see close() (closing does not interrupt it)
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                    self.requests += 1
                    if self.answer:
                        conn.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture(params=sorted(ANSWERS))
def server(request: pytest.FixtureRequest) -> Iterator[GarbageServer]:
    served = GarbageServer(ANSWERS[request.param])
    yield served
    served.close()


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}


def test_a_bad_prefect_endpoint_never_fails_a_committed_save(
    server: GarbageServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    state = _state()
    ckpt = Checkpointer(
        "events", tmp_path / "hot", catalog=url, prefect_api_url=f"http://127.0.0.1:{server.port}/api"
    )
    with caplog.at_level(logging.WARNING):
        assert ckpt.restore(state) == 0
        assert ckpt.save(5, state)
        stats = ckpt.wait()  # raised CheckpointSaveError before: the event error failed the save
        ckpt.close()
    assert server.requests == 1
    assert stats is not None and stats.outcome == "committed"
    assert len(stats.after_commit_errors) == 1 and "event not delivered" in stats.after_commit_errors[0]
    assert (ckpt.stats.committed, ckpt.stats.failed, ckpt.stats.after_commit_errors) == (1, 0, 1)
    assert "event not delivered to" in caplog.text
    assert "illegal" not in caplog.text  # the committed row was never marked abandoned
    catalog = Catalog.open(url)
    try:
        (cp,) = catalog.checkpoints("events")
        assert cp.state == CheckpointState.COMMITTED
        assert [(r.tier, r.state) for r in catalog.replicas(cp.id)] == [("hot", ReplicaState.READY)]
        # The event stays in the outbox, undelivered, for reconcile to emit.
        assert [(e.run, e.step) for e in catalog.undelivered_events()] == [("events", 5)]
    finally:
        catalog.dispose()


def test_https_to_a_plaintext_port_is_a_failed_delivery(tmp_path: Path) -> None:
    served = GarbageServer(ANSWERS["ssh banner"])
    try:
        poster = EventPoster(f"https://127.0.0.1:{served.port}/api", timeout_s=5)
        assert poster.post([{"event": "x"}]) is False
        assert poster.last_error is not None and "SSL" in poster.last_error
    finally:
        served.close()


@pytest.mark.parametrize("bad", ["http://[::1/api", "http://127.0.0.1:99999/api", "http:///api"])
def test_a_malformed_api_url_is_refused_when_the_checkpointer_is_built(tmp_path: Path, bad: str) -> None:
    # Before, it was accepted and the first post raised ValueError in the background, after a commit.
    with pytest.raises(ValueError, match=r"EventPoster\.api_url"):
        Checkpointer("events", tmp_path / "hot", prefect_api_url=bad)


def test_close_raises_one_error_naming_every_failed_save(tmp_path: Path) -> None:
    def disk_error(name: str) -> None:
        raise OSError(28, "No space left on device", name)

    state = _state()
    ckpt = Checkpointer(
        "fails", tmp_path / "hot", options=CheckpointOptions(on_busy="wait"), write_hook=disk_error
    )
    assert ckpt.restore(state) == 0
    assert ckpt.save(1, state)
    assert ckpt.save(2, state)  # waits for save 1, keeps its error, starts save 2
    with pytest.raises(CheckpointSaveError) as raised:
        ckpt.close()
    message = str(raised.value)
    assert message.startswith("2 background checkpoint saves failed")
    assert "step 1:" in message and "step 2:" in message and "No space left on device" in message
    assert len(raised.value.errors) == 2
    assert raised.value.__cause__ is raised.value.errors[0]
    assert ckpt.stats.failed == 2
