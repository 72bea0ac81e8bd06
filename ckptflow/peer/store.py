"""The file-system side of a peer server: one node's hot root, receiving and serving part replicas.

Every operation takes names from the network (run, step, part, file path), so each is validated
first (``check_run_name``, ``PartId.parse``, ``safe_relative_path``) and every path opened or
created is checked to resolve inside the hot root (a planted symlink never takes a write or a read
elsewhere). Receiving follows the hot tier's commit protocol: files into a partial directory, each
checked against the manifest while written and renamed into place only when whole and verified;
commit makes every file durable (:mod:`ckptflow.peer.receiver`) and publishes the replica as every
checkpoint is published (:mod:`ckptflow.storage.publish`: manifest last, fsync, rename, parent fsync).

Errors meant for the client are :class:`Refused` (an HTTP status and a message naming the fix).
The layout is in :mod:`ckptflow.peer.identity`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ckptflow.peer.auth import printable
from ckptflow.peer.decision_order import describe, supersedes
from ckptflow.peer.errors import Refused
from ckptflow.peer.identity import (
    PEERS_DIR,
    RESERVED_PREFIX,
    PartId,
    replica_dir,
    replica_entries,
    replica_root,
    reserved,
)
from ckptflow.peer.receiver import Durability, FileReceiver
from ckptflow.storage import checksums, layout
from ckptflow.storage.atomic import fsync_path, write_file_atomic
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, ManifestError, parse_manifest
from ckptflow.storage.manifest import safe_relative_path as _safe_path
from ckptflow.storage.publish import publish, retire
from ckptflow.storage.run_names import check_run_name
from ckptflow.storage.verify import verify_files

log = logging.getLogger("ckptflow.peer")

PENDING_MANIFEST = f"{RESERVED_PREFIX}manifest.json"
RECV_PREFIX = f"{RESERVED_PREFIX}recv-"
MAX_REASON_CHARS = 2000


@dataclass(frozen=True)
class HeldReplica:
    """A part this node can serve: a peer replica it received, or its own part of a decided step."""

    run: str
    step: int
    part: str  # part-<k>-of-<n>
    source: str  # "peer" (under peers/) or "own" (this node's step-N/)
    manifest_checksum: str  # CRC64NVME of the manifest's bytes: the checkpoint's identity
    files: dict[str, int] = field(default_factory=dict)  # path -> size

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


def manifest_id(manifest_bytes: bytes) -> str:
    """The id of a manifest in partial-directory names: its CRC64NVME as 16 hex digits."""
    return f"{checksums.crc64nvme(manifest_bytes):016x}"


class ReplicaStore:
    """Replicas under one node's hot root (see :mod:`ckptflow.peer.identity` for the layout)."""

    def __init__(self, hot_root: str | os.PathLike[str]) -> None:
        self.hot_root = Path(hot_root)
        if not self.hot_root.is_dir():
            raise ValueError(f"peer server: hot root {self.hot_root} is not a directory")
        self._real_root = self.hot_root.resolve()
        self._locks: dict[tuple[str, int, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.durability = Durability()

    def close(self) -> None:
        """Wait for the background fsyncs still running."""
        self.durability.close()

    # --- validation ---------------------------------------------------------------------------

    def _names(self, run: str, step: int, part: str) -> PartId:
        try:
            check_run_name(run, "run")
        except ValueError as exc:
            raise Refused(400, str(exc)) from None
        if not isinstance(step, int) or step < 0:
            raise Refused(400, f"step must be an integer >= 0, got {step!r}")
        try:
            return PartId.parse(part)
        except ValueError as exc:
            raise Refused(400, str(exc)) from None

    def _inside(self, path: Path) -> Path:
        """``path`` if it resolves (symlinks followed) under the hot root; Refused otherwise."""
        resolved = path.resolve()
        if resolved == self._real_root or not resolved.is_relative_to(self._real_root):
            log.warning("peer server: refused %s: it resolves outside the hot root %s", path, self._real_root)
            raise Refused(403, f"{path} resolves outside this node's hot root; refused")
        return path

    def _manifest(self, data: bytes, run: str, step: int, part: PartId) -> tuple[Manifest, list[FileEntry]]:
        try:
            manifest = parse_manifest(data, where=f"manifest sent for run {run!r} step {step}")
        except ManifestError as exc:
            raise Refused(422, str(exc)) from None
        if manifest.run != run or manifest.step != step:
            raise Refused(
                422, f"the manifest is of run {manifest.run!r} step {manifest.step}, not {run!r} step {step}"
            )
        try:
            actual = PartId.of(manifest, part.node)
        except ValueError as exc:
            raise Refused(422, str(exc)) from None
        if actual != part:
            raise Refused(
                422, f"the manifest's save had {actual.nodes} node(s): its part is {actual}, not {part}"
            )
        entries = replica_entries(manifest, part.node)
        if not entries:
            raise Refused(422, f"{part} of run {run!r} step {step} has no files in its manifest")
        clash = next((e.path for e in entries if reserved(e.path)), None)
        if clash is not None:
            raise Refused(422, f"manifest path {clash!r} collides with the transport's own file names")
        return manifest, entries

    def _lock(self, run: str, step: int, part: PartId) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((run, step, part.name), threading.Lock())

    def _partial(self, run: str, step: int, part: PartId, mid: str) -> Path:
        if len(mid) != 16 or any(c not in "0123456789abcdef" for c in mid):
            raise Refused(400, f"manifest id {mid!r} is not 16 lower-case hex digits")
        return replica_root(self.hot_root, run, part) / layout.partial_name(step, f"recv-{mid}")

    def _committed_same(self, final: Path, manifest_bytes: bytes) -> bool:
        """True if ``final`` holds this very replica, False if nothing or an older decision of the
        step (:mod:`.decision_order`: the incoming one replaces it at commit); ``Refused`` (410) if
        it holds a newer decision: the push is of a superseded checkpoint."""
        held = self._held_manifest(final)
        if held is None or held == manifest_bytes:
            return held is not None
        incoming_manifest = parse_manifest(manifest_bytes, where="the manifest sent")
        try:
            held_manifest = parse_manifest(held, where=str(final / MANIFEST_NAME))
        except ManifestError:
            return False  # an unreadable replica is no decision: the push replaces it
        if supersedes(incoming_manifest, held_manifest):
            return False
        raise Refused(
            410,
            f"superseded: this node holds {final.parent.name}/{final.name} of another decision of step "
            f"{incoming_manifest.step} ({describe(held_manifest)}), newer than the one pushed "
            f"({describe(incoming_manifest)}); the pushed checkpoint was saved again since and needs no copy",
        )

    @staticmethod
    def _held_manifest(final: Path) -> bytes | None:
        try:
            return (final / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            return None

    def _replace_superseded(self, final: Path) -> None:
        """Set aside the replica of an older decision at ``final`` just before the newer one is
        published there (under the replica's lock): manifest first, so a reader never takes the old
        files for the new checkpoint; a crash in between leaves no replica, never a mixed one."""
        if self._held_manifest(final) is not None:
            retire(final, manifest_first=True, strict=False)
            log.warning("peer replica %s: an older decision of the step is replaced by a newer one", final)

    # --- receiving ----------------------------------------------------------------------------

    def open(self, run: str, step: int, part_name: str, manifest_bytes: bytes) -> dict[str, object]:
        """Start (or resume) receiving a replica: ``{"committed", "manifest_id", "complete"}``,
        ``complete`` listing the files already received whole and verified."""
        part = self._names(run, step, part_name)
        _, entries = self._manifest(manifest_bytes, run, step, part)
        mid = manifest_id(manifest_bytes)
        final = replica_dir(self.hot_root, run, step, part)
        with self._lock(run, step, part):  # never half-way through another sender's commit
            if self._committed_same(final, manifest_bytes):
                return {"committed": True, "manifest_id": mid, "complete": [e.path for e in entries]}
            partial = self._partial(run, step, part, mid)
            self._inside(partial)  # before creating anything: a planted symlink must take no mkdir elsewhere
            partial.mkdir(parents=True, exist_ok=True)
            pending = partial / PENDING_MANIFEST
            if not pending.is_file():
                write_file_atomic(pending, manifest_bytes)
            elif pending.read_bytes() != manifest_bytes:
                raise Refused(409, f"{partial.name} holds another manifest with the same id; remove it")
            os.utime(partial)  # activity: stale-partial cleanup counts age from here
            complete = [e.path for e in entries if self.durability.complete(partial / e.path, e)]
            return {"committed": False, "manifest_id": mid, "complete": complete}

    def begin_file(
        self, run: str, step: int, part_name: str, mid: str, path: str, size: int, crc: str
    ) -> FileReceiver | None:
        """A receiver for one file of an opened replica, or None if it is already there whole.
        ``size`` and ``crc`` are what the sender claims; they must be the manifest's."""
        part = self._names(run, step, part_name)
        try:
            path = _safe_path(path, "file path")
        except ManifestError as exc:
            raise Refused(400, str(exc)) from None
        # Under the replica's lock: a commit either sees this receiver's writer lock, or has already
        # published the replica (then this file needs nothing), never the half-way state between.
        with self._lock(run, step, part):
            partial = self._partial(run, step, part, mid)
            try:
                manifest_bytes = (partial / PENDING_MANIFEST).read_bytes()
            except FileNotFoundError:
                if self._committed_id(run, step, part) == mid:
                    return None  # another sender of the same replica committed it meanwhile
                raise Refused(
                    409,
                    f"no replica of {part} of run {run!r} step {step} is being received under manifest id "
                    f"{mid}; open it first (POST .../open with the manifest)",
                ) from None
            _, entries = self._manifest(manifest_bytes, run, step, part)
            entry = next((e for e in entries if e.path == path), None)
            if entry is None:
                raise Refused(404, f"{path!r} is not a file of {part} of run {run!r} step {step}")
            if size != entry.size or crc != entry.checksum:
                raise Refused(
                    422,
                    f"{path}: the request says {size} bytes, crc64nvme {crc}; the manifest says {entry.size} "
                    f"bytes, {entry.checksum}",
                )
            target = partial / path
            if self.durability.complete(target, entry):
                return None
            self._inside(target.parent)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{RECV_PREFIX}{secrets.token_hex(4)}-{target.name}")
            lock = partial / f"{layout.LOCK_PREFIX}{secrets.randbelow(1 << 30)}"
            return FileReceiver(partial, tmp, target, entry, lock, self.durability)

    def _committed_id(self, run: str, step: int, part: PartId) -> str | None:
        try:
            return manifest_id((replica_dir(self.hot_root, run, step, part) / MANIFEST_NAME).read_bytes())
        except OSError:
            return None

    def commit(self, run: str, step: int, part_name: str, manifest_bytes: bytes) -> dict[str, object]:
        """Publish a fully received replica: every file present whole, the manifest written last,
        fsync, rename into place, fsync the parent. Idempotent for the same manifest."""
        part = self._names(run, step, part_name)
        _, entries = self._manifest(manifest_bytes, run, step, part)
        final = replica_dir(self.hot_root, run, step, part)
        with self._lock(run, step, part):
            if self._committed_same(final, manifest_bytes):
                return {"committed": True, "already": True, "files": len(entries)}
            partial = self._partial(run, step, part, manifest_id(manifest_bytes))
            self._inside(partial.parent)
            try:
                pending = (partial / PENDING_MANIFEST).read_bytes()
            except FileNotFoundError:
                raise Refused(
                    409, f"nothing of {part} of run {run!r} step {step} was received; push it first"
                ) from None
            if pending != manifest_bytes:
                raise Refused(409, "the manifest to commit is not the one the replica was opened with")
            missing = [e.path for e in entries if not self.durability.complete(partial / e.path, e)]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise Refused(
                    409, f"cannot commit {part} of step {step}: {missing[0]} was not received{more}"
                )
            if layout.someone_writes(partial):
                # Another sender of the same replica is mid-file: 503, which clients retry shortly.
                raise Refused(503, f"a file of {part} of step {step} is still being received; commit later")
            try:
                self.durability.wait(partial, [partial / e.path for e in entries])
            except OSError as exc:
                raise Refused(
                    507, f"cannot make {part} of step {step} durable: {exc.strerror or exc}"
                ) from None
            # The files are durable (the receiver fsynced each); their subdirectories' entries next.
            subdirs = {(partial / e.path).parent for e in entries} - {partial}
            deepest_first = sorted(subdirs, key=lambda p: -len(p.parts))
            self._replace_superseded(final)
            published = publish(
                partial,
                final,
                manifest_bytes,
                leftovers=[partial / PENDING_MANIFEST, *partial.rglob(f"{RECV_PREFIX}*")],
                make_durable=lambda: [fsync_path(d) for d in deepest_first],
            )
            self.durability.forget(partial)
            if not published:
                shutil.rmtree(partial, ignore_errors=True)
                self._committed_same(final, manifest_bytes)  # raises if someone put another there
        log.info("peer replica committed: %s (%d files)", final, len(entries))
        return {"committed": True, "already": False, "files": len(entries)}

    # --- serving ------------------------------------------------------------------------------

    def _own(self, run: str, step: int, part: PartId) -> tuple[Path, bytes, list[FileEntry]] | None:
        """This node's own ``step-N/`` if it holds the decided manifest and every file of ``part``."""
        directory = self.hot_root / run / layout.committed_name(step)
        try:
            data = (directory / MANIFEST_NAME).read_bytes()
            manifest = parse_manifest(data, where=str(directory / MANIFEST_NAME))
            entries = replica_entries(manifest, part.node)
        except (OSError, ValueError):
            return None
        if PartId.of(manifest, part.node) != part:
            return None
        if not all(_whole(directory / e.path, e.size) for e in entries):
            return None
        return directory, data, entries

    def _held(self, run: str, step: int, part: PartId) -> tuple[Path, bytes, list[FileEntry], str] | None:
        directory = replica_dir(self.hot_root, run, step, part)
        try:
            data = (directory / MANIFEST_NAME).read_bytes()
            _, entries = self._manifest(data, run, step, part)
            return directory, data, entries, "peer"
        except (OSError, Refused):
            own = self._own(run, step, part)
            return None if own is None else (*own, "own")

    def manifest(self, run: str, step: int, part_name: str) -> bytes:
        """The manifest bytes of a held replica (peer copy first, else this node's own part)."""
        part = self._names(run, step, part_name)
        held = self._held(run, step, part)
        if held is None:
            raise Refused(404, f"this node holds no copy of {part} of run {run!r} step {step}")
        self._inside(held[0])
        return held[1]

    def locate(self, run: str, step: int, part_name: str, path: str) -> tuple[Path, FileEntry]:
        """The file to serve for a fetch, and its manifest entry (size, CRC)."""
        part = self._names(run, step, part_name)
        try:
            path = _safe_path(path, "file path")
        except ManifestError as exc:
            raise Refused(400, str(exc)) from None
        held = self._held(run, step, part)
        if held is None:
            raise Refused(404, f"this node holds no copy of {part} of run {run!r} step {step}")
        directory, _, entries, _ = held
        entry = next((e for e in entries if e.path == path), None)
        if entry is None:
            raise Refused(404, f"{path!r} is not a file of {part} of run {run!r} step {step}")
        return self._inside(directory / path), entry

    def held(self, run: str | None = None) -> list[HeldReplica]:
        """Every part this node can serve (of ``run``, or of every run), newest step first."""
        if run is not None:
            self._names(run, 0, "part-0-of-1")
            runs = [run] if (self.hot_root / run).is_dir() else []
        else:
            runs = sorted(p.name for p in self.hot_root.iterdir() if p.is_dir() and _valid_run(p.name))
        found: list[HeldReplica] = []
        for name in runs:
            found += self._held_of_run(name)
        found.sort(key=lambda h: (h.run, -h.step, h.part, h.source))
        return found

    def _held_of_run(self, run: str) -> list[HeldReplica]:
        out: list[HeldReplica] = []
        peers = self.hot_root / run / PEERS_DIR
        for part_dir in sorted(peers.iterdir()) if peers.is_dir() else []:
            try:
                part = PartId.parse(part_dir.name)
            except ValueError:
                continue
            for entry in layout.scan(part_dir):
                held = self._held(run, entry.step, part) if entry.kind == "committed" else None
                if held is not None and held[3] == "peer":
                    out.append(_describe(run, entry.step, part, held))
        for entry in layout.scan(self.hot_root / run):
            if entry.kind != "committed":
                continue
            try:
                manifest = parse_manifest((entry.path / MANIFEST_NAME).read_bytes(), str(entry.path))
            except (OSError, ValueError):
                continue
            for node in sorted(n.node for n in manifest.nodes) or [0]:
                part = PartId.of(manifest, node)
                own = self._own(run, entry.step, part)
                if own is not None:
                    out.append(_describe(run, entry.step, part, (*own, "own")))
        return out

    # --- retention and quarantine -------------------------------------------------------------

    def delete(self, run: str, step: int, part_name: str) -> bool:
        """Remove a peer replica (manifest first, then rename aside, then the files); False if this
        node holds none. A node's own part is its hot retention's to remove, never this call's."""
        part = self._names(run, step, part_name)
        directory = replica_dir(self.hot_root, run, step, part)
        with self._lock(run, step, part):
            if not directory.exists():
                return False
            self._inside(directory)
            retire(directory, manifest_first=True)
        log.info("peer replica deleted: %s", directory)
        return True

    def quarantine(self, run: str, step: int, part_name: str, reason: str, path: str | None = None) -> str:
        """Move a held copy of ``part`` that fails verification aside (never deleted): the peer
        replica if there is one, else this node's own part (the same bytes served as that part).

        Only on this node's own evidence: the fetcher's report (``reason``, naming ``path``, or
        every file when None) is a claim, and a bit flipped in transit or in the fetcher's memory
        must not cost a good copy, least of all a node's own part. So the copy is read again here
        and checked against its manifest; if it verifies, Refused(409) and nothing moves."""
        part = self._names(run, step, part_name)
        reason = "".join(c if c.isprintable() else " " for c in str(reason))[:MAX_REASON_CHARS]
        with self._lock(run, step, part):
            held = self._held(run, step, part)
            if held is None:
                raise Refused(404, f"this node holds no copy of {part} of run {run!r} step {step}")
            directory, _, entries, source = held
            self._inside(directory)
            suspects = entries if path is None else [e for e in entries if e.path == path]
            if not suspects:
                raise Refused(404, f"{path!r} is not a file of {part} of run {run!r} step {step}")
            problems = verify_files(directory, suspects)
            if not problems:
                log.warning(
                    "peer server: a fetcher reported %s of step %d corrupt (%s), but this node's %s copy "
                    "verifies against its manifest; not quarantined",
                    part, step, printable(reason), source,
                )  # fmt: skip
                what = path if path is not None else f"every file of {part}"
                raise Refused(
                    409,
                    f"this node's copy of {what} (run {run!r} step {step}) was read again and verifies "
                    "against its manifest: the damage was in transit or in the fetcher; not quarantined, "
                    "fetch it again",
                )
            found = "; ".join(str(p) for p in problems)
            root = directory.parent
            moved = layout.quarantine(
                root, directory, f"fetched as {part} by a peer: {reason}; verified here: {found}"
            )
        log.error(
            "peer replica quarantined (%s copy of %s, step %d): %s: %s", source, part, step, moved, found
        )
        return str(moved)

    def cleanup_stale(self, older_than_s: float) -> list[str]:
        """Remove partial receives no live request is writing and older than ``older_than_s``
        (a sender that died mid-push), and interrupted deletes; return what was removed."""
        removed: list[str] = []
        for run_dir in sorted(p for p in self.hot_root.iterdir() if p.is_dir() and _valid_run(p.name)):
            peers = run_dir / PEERS_DIR
            if not peers.is_dir() or peers.is_symlink():
                continue
            for part_dir in sorted(p for p in peers.iterdir() if p.is_dir() and not p.is_symlink()):
                with contextlib.suppress(FileNotFoundError):
                    for gone in layout.remove_stale_partials(part_dir, older_than_s):
                        self.durability.forget(gone)
                        removed.append(str(gone))
        return removed


def _whole(path: Path, size: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size == size
    except OSError:
        return False


def _valid_run(name: str) -> bool:
    try:
        check_run_name(name)
    except ValueError:
        return False
    return True


def _describe(
    run: str, step: int, part: PartId, held: tuple[Path, bytes, list[FileEntry], str]
) -> HeldReplica:
    _, data, entries, source = held
    return HeldReplica(
        run, step, part.name, source, checksums.checksum_bytes(data), {e.path: e.size for e in entries}
    )
