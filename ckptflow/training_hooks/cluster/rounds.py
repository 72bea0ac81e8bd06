"""A round of messages over the coordination store: the one mechanism every exchange between ranks
outside the process group is built on (the two-level commit, :mod:`..commit.protocol`, and restore's
wait for every node's fetch, :func:`exchange`).

A round owns the keys under one prefix, unique to it (a save attempt, a restore attempt), so rounds
never read each other's messages. Its participants post JSON bodies under names (``rank/3``,
``part/1``, ``decision``), wait for a set of names with a bound (a wait never outlasts its deadline,
and what did not arrive is named), and delete the round once nobody reads it any more: the last
participant to leave counts itself on a counter and removes every key (:meth:`StoreRound.leave`).
A store that fails raises :class:`..cluster.coord_store.StoreUnavailable`; the caller decides what
an unreachable store means for its round.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptflow.training_hooks.cluster.coord_store import CoordinationStore, StoreUnavailable
from ckptflow.training_hooks.cluster.large_values import chunk_key, join, marker_of, split

CHUNKS_WAIT_S = 60.0  # a reader of a marker waits this long for the chunks a live writer posts
CHUNKED = "chunked"  # a counter of the round's bodies posted in chunks: absent in almost every round


@dataclass(frozen=True)
class StoreRound:
    """The keys of one round, ``<prefix><name>``, and the bounded operations on them."""

    store: CoordinationStore
    prefix: str

    def key(self, name: str) -> str:
        return self.prefix + name

    def post(self, name: str, body: Any) -> None:
        """Post ``body`` (JSON-serializable) under ``name`` (in chunks behind a marker when it is
        larger than one store value may be: :mod:`.large_values`)."""
        key, data = self.key(name), json.dumps(body).encode()
        parts = split(data)
        if parts is None:
            self.store.set(key, data)
            return
        marker, chunks = parts
        self._post_chunks(key, chunks)
        self.store.set(key, marker.to_bytes())  # last: a reader of the marker finds every chunk

    def _post_chunks(self, key: str, chunks: list[bytes]) -> None:
        """Post a large body's chunks, counted first (:meth:`forget` looks for chunks only in a
        round that has some)."""
        self.store.add(self.key(CHUNKED), 1)
        for index, chunk in enumerate(chunks):
            self.store.set(chunk_key(key, index), chunk)

    def decide(self, name: str, body: Any) -> Any:
        """Post ``body`` under ``name`` unless someone posted there first; return the body that
        holds (first writer wins, atomically): every participant that decides, or reads, acts on
        the same answer. A large body's marker is what the writers race for; the winner then posts
        the chunks, which readers of the marker wait for (bounded)."""
        key, data = self.key(name), json.dumps(body).encode()
        parts = split(data)
        if parts is None:
            held = self.store.set_if_absent(key, data)
            return body if held == data else self._held(key, held)
        marker, chunks = parts
        held = self.store.set_if_absent(key, marker.to_bytes())
        if held != marker.to_bytes():
            return self._held(key, held)
        self._post_chunks(key, chunks)
        return body

    def _held(self, key: str, value: bytes) -> Any:
        """The body another writer decided (``value``: what the key holds)."""
        resolved = self._resolve(key, value)
        if resolved is None:  # deleted: only the last participant deletes, after every decision
            raise StoreUnavailable(f"{key}: the round was deleted while this participant decided")
        return json.loads(resolved)

    def read_if_present(self, name: str) -> Any | None:
        """The body under ``name``, or None if none is (yet, or any more) posted: one atomic read,
        so a round deleted meanwhile never turns into a wait for a key that will not come."""
        key = self.key(name)
        value = self.store.get_if_present(key)
        resolved = None if value is None else self._resolve(key, value)
        return None if resolved is None else json.loads(resolved)

    def _resolve(self, key: str, value: bytes) -> bytes | None:
        """``value`` itself, or, if it is a marker, the body its chunks make (waiting up to
        :data:`CHUNKS_WAIT_S` for a writer still posting them); None if the round was deleted
        meanwhile; :class:`StoreUnavailable` if the chunks never came or do not verify."""
        marker = marker_of(value)
        if marker is None:
            return value
        keys = [chunk_key(key, i) for i in range(marker.count)]
        if not self.store.wait(keys, CHUNKS_WAIT_S):
            if self.store.get_if_present(key) is None:
                return None
            raise StoreUnavailable(
                f"{key}: its {marker.count} chunks did not all arrive in {CHUNKS_WAIT_S:g} s"
            )
        try:
            return join(marker, self.store.multi_get(keys), key)
        except ValueError as exc:
            raise StoreUnavailable(str(exc)) from None

    def await_one(self, name: str, timeout_s: float) -> Any | None:
        """The body under ``name`` once posted, or None if it was not within ``timeout_s`` (or the
        round was deleted meanwhile)."""
        if not self.store.wait([self.key(name)], timeout_s):
            return None
        return self.read_if_present(name)

    def missing_after(self, names: Sequence[str], timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` for every one of ``names``; return those still not posted."""
        keys = [self.key(n) for n in names]
        if self.store.wait(keys, timeout_s):
            return []
        absent = set(self.store.missing(keys))
        return [n for n, k in zip(names, keys, strict=True) if k in absent]

    def gather(self, names: Sequence[str], timeout_s: float) -> tuple[dict[str, Any], list[str]]:
        """The bodies posted under ``names`` once all are, or what is there after ``timeout_s``:
        (bodies by name, the names missing)."""
        missing = set(self.missing_after(names, timeout_s))
        present = [n for n in names if n not in missing]
        values = self.store.multi_get([self.key(n) for n in present])
        bodies: dict[str, Any] = {}
        for name, value in zip(present, values, strict=True):
            resolved = self._resolve(self.key(name), value)
            if resolved is None:
                missing.add(name)
            else:
                bodies[name] = json.loads(resolved)
        return bodies, [n for n in names if n in missing]

    def forget(self, names: Sequence[str], *, final: bool = False) -> None:
        """Delete the keys of ``names`` and any chunks of theirs (a missing key is no error);
        ``final``: the round is over, its chunk counter goes too. A round that posted nothing in
        chunks (almost every one) costs one read more, never a probe per name."""
        keys = [self.key(n) for n in names]
        self.store.delete(keys)
        if self.store.get_if_present(self.key(CHUNKED)) is not None:
            for key in keys:
                index = 0
                while self.store.delete_if_present(chunk_key(key, index)):
                    index += 1
        if final:
            self.store.delete([self.key(CHUNKED)])

    def leave(self, participants: int, names: Sequence[str], counter: str = "read") -> bool:
        """Count this participant out; the last of ``participants`` to leave deletes ``names`` and
        the counter (nobody reads them any more). True for the last one."""
        if self.store.add(self.key(counter), 1) == participants:
            self.forget([*names, counter], final=True)
            return True
        return False


def exchange(
    round_: StoreRound, rank: int, world_size: int, mine: dict[str, Any], timeout_s: float, doing: str
) -> list[dict[str, Any]]:
    """Every rank's ``mine`` (rank order), through the store: each rank posts its own, rank 0 waits
    for all within ``timeout_s`` and posts a summary, every rank reads the summary (within
    ``timeout_s`` + 60 s: rank 0's own wait comes first) and the last reader deletes the round.

    A rank that did not post within ``timeout_s`` gets ``{"ok": False, "error": ...}`` (naming what
    it was ``doing``) in its place;
    a summary that does not come raises ``TimeoutError`` naming the bound. The wait can outlast any
    process-group timeout (a long fetch on another node), which is why this is not a collective.
    """
    if world_size == 1:
        return [mine]
    names = [f"rank/{r}" for r in range(world_size)]
    round_.post(names[rank], mine)
    if rank == 0:
        bodies, late = round_.gather(names, timeout_s)
        if late:
            summary: dict[str, Any] = {"late": [n.rsplit("/", 1)[1] for n in late]}
        else:
            summary = {"results": [bodies[n] for n in names]}
        round_.post("summary", summary)
    body = round_.await_one("summary", timeout_s + 60.0)
    if body is None:
        raise TimeoutError(f"no summary of {doing} from rank 0 within {timeout_s:g} s")
    round_.leave(world_size, [*names, "summary"])
    if "late" in body:
        return [
            {"ok": False, "error": f"did not finish {doing} within {timeout_s:g} s"}
            if str(r) in body["late"]
            else {"ok": True}
            for r in range(world_size)
        ]
    return body["results"]
