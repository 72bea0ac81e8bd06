"""The c10d Store that ranks coordinate checkpoints through: a dedicated client, never the training PG.

The background writer must never run a collective on the training process group (two threads
driving one group deadlock), and a blocking ``wait`` on a Store object stalls every other use of
that same object (``TCPStore`` holds one lock per client for the whole call). So each Checkpointer
opens a client of its own:

- under torchrun (``MASTER_ADDR``/``MASTER_PORT`` set; the elastic agent or rank 0 hosts the store)
  a ``TCPStore`` client of that store;
- otherwise rank 0 hosts a ``TCPStore`` on a socket it binds itself (on ``127.0.0.1`` when every
  rank runs on rank 0's host, else on the configured ``store_host``) and tells the others the
  address over the process group, once, in the training thread;
- a single process uses an in-memory ``HashStore``.

A store that is gone reads as "not committed", never "committed": every operation that fails is
raised as :class:`StoreUnavailable` and the caller abandons what it was deciding.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

import torch.distributed as dist

from ckptflow.training_hooks.cluster import ranks
from ckptflow.training_hooks.cluster.nodes import Topology

StoreMode = Literal["auto", "env", "rank0"]

# No value the commit protocol stores (JSON, b"1") starts with a NUL byte.
_ABSENT = b"\x00ckptflow: no such key\x00"


class StoreUnavailable(RuntimeError):
    """The coordination store could not be reached or answered with an error."""


class CoordinationStore:
    """A key-value view of one c10d Store: bytes values, bounded waits, an operation counter.

    ``ops`` counts round trips to the store (a multi-key call counts once), ``bytes_out`` and
    ``bytes_in`` the values this client sent and received: what the commit benchmark reports per save.
    """

    def __init__(self, store: dist.Store, label: str = "", keepalive: object = None) -> None:
        self._store = store
        self.label = label
        self.ops = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self._keepalive = keepalive  # a listening socket the store was given: it must outlive it

    def _call(self, what: str, fn: object, *args: object) -> object:
        self.ops += 1
        try:
            return fn(*args)  # type: ignore[operator]
        except (RuntimeError, OSError) as exc:  # DistError derives from RuntimeError
            raise StoreUnavailable(f"coordination store {self.label}: {what} failed: {exc}") from exc

    def set(self, key: str, value: bytes) -> None:
        """Store ``value``; returns once the store holds it.

        A ``TCPStore`` client's ``set`` only sends: the server may answer another client's ``check``
        before it has read this one, and a store that is gone goes unnoticed. The ``check`` after
        it is a round trip on the same connection, which the server answers only after the set."""
        self._call(f"set {key}", self._store.set, key, value)
        self._call(f"set {key} (confirm)", self._store.check, [key])
        self.bytes_out += len(value)

    def get(self, key: str) -> bytes:
        value: bytes = self._call(f"get {key}", self._store.get, key)  # type: ignore[assignment]
        self.bytes_in += len(value)
        return value

    def get_if_present(self, key: str) -> bytes | None:
        """The value of ``key``, or None if it does not exist; never waits, never creates it.

        ``check`` then ``get`` fails when another rank deletes the key in between (the last node
        to acknowledge deletes the round): the ``get`` waits for it until the store's timeout, or
        reads an empty value. ``compare_set`` with an expected value no key holds answers in one
        atomic step: the stored value, or (the key missing) that expected value back, without
        setting it."""
        got = self._call(f"get_if_present {key}", self._store.compare_set, key, _ABSENT, _ABSENT)
        if got == _ABSENT:
            return None
        self.bytes_in += len(got)  # type: ignore[arg-type]
        return got  # type: ignore[return-value]

    def set_if_absent(self, key: str, value: bytes) -> bytes:
        """Store ``value`` under ``key`` unless the key holds a value already; return the value the
        key holds afterwards: one atomic ``compare_set`` (expected: no value), so of several
        writers the first wins and every one of them reads the same answer. ``value`` must not be
        empty."""
        if not value:
            raise ValueError("set_if_absent: an empty value cannot be told from no value")
        held: bytes = self._call(f"set_if_absent {key}", self._store.compare_set, key, b"", value)  # type: ignore[assignment]
        self.bytes_out += len(value)
        self.bytes_in += len(held)
        return held

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        if not keys:
            return []
        values: list[bytes] = self._call(f"multi_get {keys[0]}...", self._store.multi_get, list(keys))  # type: ignore[assignment]
        self.bytes_in += sum(len(v) for v in values)
        return values

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call(f"check {keys[0]}...", self._store.check, list(keys)))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(f"add {key}", self._store.add, key, amount))  # type: ignore[arg-type]

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._call(f"delete {key}", self._store.delete_key, key)

    def delete_if_present(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        return bool(self._call(f"delete {key}", self._store.delete_key, key))

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Wait until every key exists; False if ``timeout_s`` passed first (the store still
        answers), StoreUnavailable if the store is gone."""
        if not keys:
            return True
        if timeout_s <= 0:
            return self.check(keys)
        self.ops += 1
        try:
            self._store.wait(list(keys), timedelta(seconds=timeout_s))
            return True
        except (RuntimeError, OSError) as exc:
            if "timeout" not in str(exc).lower():
                raise StoreUnavailable(f"coordination store {self.label}: wait failed: {exc}") from exc
        # A timed-out wait: make sure the store itself is still there (then it really was a timeout).
        return self.check(keys)

    def missing(self, keys: Sequence[str]) -> list[str]:
        """The keys that do not exist (one check per key: use on failure paths only)."""
        return [key for key in keys if not self.check([key])]


def open_store(
    topology: Topology,
    mode: StoreMode = "auto",
    timeout_s: float = 60.0,
    store_host: str | None = None,
) -> CoordinationStore:
    """Open this rank's dedicated coordination store (a collective in ``rank0`` mode: call on every
    rank, in the training thread)."""
    timeout = timedelta(seconds=timeout_s)
    if topology.world_size == 1:
        return CoordinationStore(dist.HashStore(), "in-process")
    env_addr, env_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if mode == "env" or (mode == "auto" and env_addr and env_port):
        if not (env_addr and env_port and env_port.isdigit()):
            raise ValueError(
                "coordination store 'env': MASTER_ADDR and MASTER_PORT must be set (torchrun sets them); "
                "use store: rank0 to let rank 0 host a store"
            )
        return CoordinationStore(_client(env_addr, int(env_port), timeout), f"{env_addr}:{env_port}")
    host = store_host or ("127.0.0.1" if len(set(topology.hosts)) == 1 else socket.getfqdn())
    server, sock = None, None
    address: tuple[str, int] | None = None
    if topology.is_coordinator:
        server, sock = _serve(host, timeout)
        address = (host, sock.getsockname()[1])
    address = ranks.broadcast(address)
    assert address is not None
    store = server if server is not None else _client(address[0], address[1], timeout)
    return CoordinationStore(store, f"{address[0]}:{address[1]} (hosted by rank 0)", keepalive=sock)


def _client(host: str, port: int, timeout: timedelta) -> dist.Store:
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as exc:
        raise StoreUnavailable(f"cannot connect to the coordination store at {host}:{port}: {exc}") from exc


def _serve(host: str, timeout: timedelta) -> tuple[dist.Store, socket.socket]:
    """A TCPStore server on a socket bound to ``host`` only (TCPStore alone would listen on every
    interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=sock.fileno()
    )
    return store, sock
