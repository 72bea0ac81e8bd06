"""The peer client: push a committed part to a peer, fetch a part back, manage held replicas.

Synchronous httpx over one keep-alive connection per :class:`PeerClient`, every request signed
(:mod:`ckptflow.peer.auth`), connect and read timeouts, and bounded retries with exponential
back-off on transport errors and 502/503/504 (never on a 4xx: the peer said no, and why).

- :meth:`PeerClient.push_part` opens the replica on the peer (which answers what it already has
  whole), sends each missing file with its size and CRC64NVME, capped by a token bucket, then
  commits. A rerun after any interruption sends only what the peer lacks; nothing twice.
- :meth:`PeerClient.fetch_part` mirrors ``Tier.fetch_files``: each file checked against its
  manifest entry while downloaded, written under a temporary name (``.<name>.fetch-<id>``, which
  the restore inventory ignores), fsynced and renamed into place; a file already there is never
  written over. A transfer cut mid-file resumes with a ``Range`` request. A mismatch raises
  :class:`PeerCorrupt` naming the file; :meth:`quarantine_replica` then moves the peer's copy aside.

Module-level functions of the same names take ``(peer_url, secret, ...)`` and use a client each.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from ckptflow.peer.auth import PeerSecret, as_secret, authorization
from ckptflow.peer.bandwidth import TokenBucket
from ckptflow.peer.errors import (
    LocalFileCorrupt,
    PeerAuthError,
    PeerCorrupt,
    PeerError,
    PeerMissing,
    PeerRefused,
    PeerUnavailable,
)
from ckptflow.peer.identity import PartId, replica_entries
from ckptflow.peer.store import HeldReplica
from ckptflow.storage import checksums
from ckptflow.storage.atomic import fsync_path
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, parse_manifest, safe_relative_path
from ckptflow.storage.run_names import check_run_name
from ckptflow.storage.tier import Progress, TransferResult

CHUNK = 1 << 20
FETCH_TMP_MARK = ".fetch-"  # as ckptflow.training_hooks.inventory.FETCH_TMP_MARK: ignored by inventories
RETRY_STATUSES = frozenset({502, 503, 504})


@dataclass
class PushResult:
    """What one push of a part to one peer did."""

    peer: str
    part: str
    files_sent: int = 0
    bytes_sent: int = 0
    files_skipped: int = 0  # already whole on the peer (a resumed push)
    already_committed: bool = False
    seconds: float = 0.0
    throttled_s: float = 0.0  # time held back by the bandwidth cap


class _Signer(httpx.Auth):
    def __init__(self, secret: PeerSecret) -> None:
        self._secret = secret

    def auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        target = request.url.raw_path.decode("ascii")
        request.headers["Authorization"] = authorization(
            self._secret, request.method, target, request.headers
        )
        yield request


def _check_url(url: str) -> str:
    parsed = httpx.URL(url)
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.host
        or parsed.path not in ("", "/")
        or parsed.query
    ):
        raise ValueError(f"peer_url {url!r} must be http(s)://host:port with no path or query")
    return str(parsed.copy_with(path="/")).rstrip("/")


def _files_path(run: str, step: int, part: PartId, path: str | None = None) -> str:
    base = f"/v1/replicas/{quote(check_run_name(run), safe='')}/{int(step)}/{part.name}"
    if path is None:
        return base
    return f"{base}/files/{quote(safe_relative_path(path, 'file path'), safe='/')}"


def _body_headers(body: bytes) -> dict[str, str]:
    return {"X-Ckptflow-Body-Sha256": hashlib.sha256(body).hexdigest(), "Content-Type": "application/json"}


class PeerClient:
    """A connection to one peer's server (a context manager; :meth:`close` when done)."""

    def __init__(
        self,
        url: str,
        secret: PeerSecret | str,
        *,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = _check_url(url)
        self.retries = retries
        self.backoff_s = backoff_s
        self._client = httpx.Client(
            base_url=self.url,
            auth=_Signer(as_secret(secret)),
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers={"User-Agent": "ckptflow-peer"},
            trust_env=False,  # node-to-node traffic never goes through a proxy from the environment
        )

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    # --- one request, retried -----------------------------------------------------------------

    def _backoff(self, attempt: int) -> None:
        time.sleep(self.backoff_s * (2**attempt))

    def _error(self, response: httpx.Response, what: str) -> PeerError:
        try:
            detail = str(json.loads(response.read()).get("error") or response.reason_phrase)
        except (ValueError, AttributeError, httpx.HTTPError):
            detail = response.reason_phrase
        message = f"peer {self.url}: {what} refused ({response.status_code}): {detail}"
        if response.status_code == 401:
            return PeerAuthError(message)
        if response.status_code == 404:
            return PeerMissing(message, 404)
        return PeerRefused(message, response.status_code)

    def _send(
        self,
        method: str,
        path: str,
        what: str,
        *,
        content: bytes | Callable[[], Iterator[bytes]] | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> httpx.Response:
        for attempt in range(self.retries + 1):
            body = content() if callable(content) else content
            try:
                request = self._client.build_request(
                    method, path, content=body, headers=headers, params=params
                )
                response = self._client.send(request)
            except httpx.TransportError as exc:
                if attempt < self.retries:
                    self._backoff(attempt)
                    continue
                raise PeerUnavailable(
                    f"peer {self.url}: {what} failed after {attempt + 1} attempt(s): "
                    f"{type(exc).__name__}: {exc}; is the peer's agent running and reachable?"
                ) from None
            if response.status_code in RETRY_STATUSES and attempt < self.retries:
                self._backoff(attempt)
                continue
            if response.status_code >= 400:
                raise self._error(response, what)
            return response
        raise AssertionError("unreachable")

    # --- push ---------------------------------------------------------------------------------

    def push_part(
        self,
        hot_step_dir: str | os.PathLike[str],
        manifest: Manifest,
        owner_part: int,
        bandwidth_bytes_per_s: float | None = None,
        *,
        bucket: TokenBucket | None = None,
        progress: Progress | None = None,
    ) -> PushResult:
        """Replicate node ``owner_part``'s part of ``manifest``'s checkpoint, read from
        ``hot_step_dir`` (which holds that part and the decided manifest), to this peer.

        ``bandwidth_bytes_per_s`` caps the bytes sent (or pass a shared ``bucket``);
        ``progress(n)`` is called after each chunk sent (an exception from it aborts the push,
        leaving nothing visible on the peer). Raises LocalFileCorrupt if a local file does not
        match the manifest, PeerError subclasses otherwise.
        """
        start = time.perf_counter()
        source = Path(hot_step_dir)
        manifest_bytes = (source / MANIFEST_NAME).read_bytes()
        if parse_manifest(manifest_bytes, where=str(source / MANIFEST_NAME)) != manifest:
            raise ValueError(f"{source}/{MANIFEST_NAME} is not the manifest passed in; refusing to push")
        part = PartId.of(manifest, owner_part)
        entries = replica_entries(manifest, owner_part)
        missing = [e.path for e in entries if not (source / e.path).is_file()]
        if missing:
            raise FileNotFoundError(f"{source}: {missing[0]} of {part} is not on this node; cannot push it")
        if bucket is None and bandwidth_bytes_per_s is not None:
            bucket = TokenBucket(bandwidth_bytes_per_s)
        result = PushResult(self.url, part.name)
        base = _files_path(manifest.run, manifest.step, part)
        opened = self._send(
            "POST", f"{base}/open", f"opening {part} of step {manifest.step}",
            content=manifest_bytes, headers=_body_headers(manifest_bytes),
        ).json()  # fmt: skip
        if opened["committed"]:
            result.already_committed = True
            result.files_skipped = len(entries)
            result.seconds = time.perf_counter() - start
            return result
        complete = set(opened["complete"])
        for entry in entries:
            if entry.path in complete:
                result.files_skipped += 1
                continue
            headers = {
                "X-Ckptflow-Size": str(entry.size),
                "X-Ckptflow-Crc64nvme": entry.checksum,
                "X-Ckptflow-Manifest": str(opened["manifest_id"]),
                "Content-Length": str(entry.size),
                "Content-Type": "application/octet-stream",
            }
            sent = _Sent()

            def body(entry: FileEntry = entry, sent: _Sent = sent) -> Iterator[bytes]:
                return _file_chunks(source / entry.path, entry, bucket, progress, sent)

            self._send(
                "PUT", _files_path(manifest.run, manifest.step, part, entry.path),
                f"sending {entry.path}", content=body, headers=headers,
            )  # fmt: skip
            result.files_sent += 1
            result.bytes_sent += entry.size
            result.throttled_s += sent.throttled_s
        self._send(
            "POST", f"{base}/commit", f"committing {part} of step {manifest.step}",
            content=manifest_bytes, headers=_body_headers(manifest_bytes),
        )  # fmt: skip
        result.seconds = time.perf_counter() - start
        return result

    # --- fetch --------------------------------------------------------------------------------

    def fetch_manifest(self, run: str, step: int, owner_part: PartId) -> bytes:
        """The manifest bytes of the peer's copy of ``owner_part`` of (run, step), checked against
        the CRC the peer sends and parsed (ManifestError if unusable)."""
        response = self._send(
            "GET", f"{_files_path(run, step, owner_part)}/manifest", f"reading {owner_part}"
        )
        data = response.content
        if checksums.checksum_bytes(data) != response.headers.get("x-ckptflow-crc64nvme"):
            raise PeerCorrupt(
                self.url, f"{run}/step-{step}/{owner_part}/{MANIFEST_NAME}", "damaged in transit"
            )
        parse_manifest(data, where=f"peer {self.url}: {run} step {step} {owner_part}")
        return data

    def fetch_part(
        self,
        run: str,
        step: int,
        owner_part: PartId,
        entries: list[FileEntry],
        dest_dir: str | os.PathLike[str],
        progress: Progress | None = None,
    ) -> TransferResult:
        """Download ``entries`` (files of ``owner_part``) into ``dest_dir``, as ``Tier.fetch_files``
        does; the result's ``bytes`` is what was downloaded. PeerCorrupt names the file whose
        bytes do not match (nothing of it kept)."""
        start = time.perf_counter()
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        fetched = files = skipped = 0
        for entry in entries:
            got = self._fetch_one(run, step, owner_part, entry, dest, progress)
            if got is None:
                skipped += 1
            else:
                fetched += got
                files += 1
        fsync_path(dest)
        return TransferResult(
            str(dest), files=files, bytes=fetched, skipped_files=skipped, seconds=time.perf_counter() - start
        )

    def _fetch_one(
        self, run: str, step: int, part: PartId, entry: FileEntry, dest: Path, progress: Progress | None
    ) -> int | None:
        final = dest / safe_relative_path(entry.path, "entry.path")
        if final.exists():
            return None
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}{FETCH_TMP_MARK}{secrets.token_hex(4)}")
        where = f"{run}/step-{step}/{part}/{entry.path}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        state = _Download()
        try:
            for attempt in range(self.retries + 1):
                try:
                    self._download(run, step, part, entry, fd, state, progress)
                    break
                except httpx.TransportError as exc:
                    if attempt == self.retries:
                        raise PeerUnavailable(
                            f"peer {self.url}: fetching {where} failed after {attempt + 1} attempt(s) "
                            f"({state.size} of {entry.size} bytes): {type(exc).__name__}: {exc}"
                        ) from None
                    self._backoff(attempt)  # then resume from state.size with a Range request
            if state.size != entry.size:
                raise PeerCorrupt(self.url, where, f"{state.size} bytes, the manifest says {entry.size}")
            actual = checksums.encode(state.crc)
            if actual != entry.checksum:
                raise PeerCorrupt(self.url, where, f"crc64nvme {actual}, the manifest says {entry.checksum}")
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return state.size

    def _download(
        self,
        run: str,
        step: int,
        part: PartId,
        entry: FileEntry,
        fd: int,
        state: _Download,
        progress: Progress | None,
    ) -> None:
        where = f"{run}/step-{step}/{part}/{entry.path}"
        headers = {"Range": f"bytes={state.size}-"} if state.size else {}
        request = self._client.build_request("GET", _files_path(run, step, part, entry.path), headers=headers)
        response = self._client.send(request, stream=True)
        try:
            if response.status_code >= 400:
                raise self._error(response, f"fetching {where}")
            claimed = (response.headers.get("x-ckptflow-size"), response.headers.get("x-ckptflow-crc64nvme"))
            if claimed != (str(entry.size), entry.checksum):
                raise PeerRefused(
                    f"peer {self.url}: {where}: the peer's manifest gives size {claimed[0]}, crc64nvme "
                    f"{claimed[1]}; ours says {entry.size}, {entry.checksum}: the peer holds another "
                    "checkpoint of this step",
                    409,
                )
            if response.status_code == 206:
                first = response.headers.get("content-range", "").removeprefix("bytes ").split("-")[0]
                if first != str(state.size):
                    raise PeerRefused(
                        f"peer {self.url}: {where}: asked for bytes {state.size}-, got {first}-", 502
                    )
            elif state.size:
                os.ftruncate(fd, 0)  # the peer sent the whole file again: start over
                os.lseek(fd, 0, os.SEEK_SET)
                state.size, state.crc = 0, 0
            for chunk in response.iter_raw():
                if state.size + len(chunk) > entry.size:
                    raise PeerCorrupt(self.url, where, f"more than the manifest's {entry.size} bytes")
                view = memoryview(chunk)
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
                state.crc = checksums.crc64nvme(view, state.crc)
                state.size += len(view)
                if progress is not None:
                    progress(len(view))
        finally:
            response.close()

    def read_range(
        self, run: str, step: int, owner_part: PartId, entry: FileEntry, offset: int, length: int
    ) -> bytes:
        """Bytes ``[offset, offset + length)`` of a file of the peer's copy, verified: the span
        must be one of the entry's blocks (or the whole file). PeerCorrupt if they do not match."""
        expected = entry.checksum if (offset, length) == (0, entry.size) else entry.block(offset, length)
        if expected is None:
            raise ValueError(
                f"{entry.path}: [{offset}, +{length}) is not a block of the manifest; only spans whose CRC "
                "the manifest records can be read verified"
            )
        where = f"{run}/step-{step}/{owner_part}/{entry.path}"
        if length == 0:
            return b""
        response = self._send(
            "GET", _files_path(run, step, owner_part, entry.path), f"reading {where}",
            headers={"Range": f"bytes={offset}-{offset + length - 1}"},
        )  # fmt: skip
        data = response.content
        if response.status_code != 206 and len(data) == entry.size:
            data = data[offset : offset + length]
        actual = checksums.checksum_bytes(data)
        if len(data) != length or actual != expected:
            raise PeerCorrupt(
                self.url, where, f"bytes [{offset}, +{length}): crc64nvme {actual}, manifest {expected}"
            )
        return data

    # --- inventory, retention, quarantine -----------------------------------------------------

    def list_replicas(self, run: str | None = None) -> list[HeldReplica]:
        """Every part the peer can serve (peer replicas and its own parts), newest step first."""
        params = {"run": check_run_name(run)} if run is not None else None
        body = self._send("GET", "/v1/replicas", "listing replicas", params=params).json()
        return [
            HeldReplica(r["run"], r["step"], r["part"], r["source"], r["manifest_checksum"], dict(r["files"]))
            for r in body["replicas"]
        ]

    def delete_replica(self, run: str, step: int, owner_part: PartId) -> bool:
        """Remove the peer's replica of ``owner_part`` of (run, step); False if it held none."""
        response = self._send(
            "DELETE", _files_path(run, step, owner_part), f"deleting {owner_part} of step {step}"
        )
        return bool(response.json()["deleted"])

    def quarantine_replica(self, run: str, step: int, owner_part: PartId, reason: str) -> str:
        """Have the peer move its copy of ``owner_part`` aside (never deleted); return where to."""
        body = json.dumps({"reason": reason}).encode()
        response = self._send(
            "POST", f"{_files_path(run, step, owner_part)}/quarantine",
            f"quarantining {owner_part} of step {step}", content=body, headers=_body_headers(body),
        )  # fmt: skip
        return str(response.json()["quarantined"])

    def health(self) -> bool:
        return bool(self._send("GET", "/v1/health", "health check").json().get("ok"))


@dataclass
class _Sent:
    throttled_s: float = 0.0


@dataclass
class _Download:
    size: int = 0
    crc: int = 0


def _file_chunks(
    path: Path, entry: FileEntry, bucket: TokenBucket | None, progress: Progress | None, sent: _Sent
) -> Iterator[bytes]:
    """The bytes of ``path`` in chunks, paced by ``bucket``, checked against ``entry`` as read. On
    a local mismatch the last chunk is withheld (LocalFileCorrupt), so the peer never receives a
    whole file to accept."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        while size < entry.size:
            chunk = f.read(min(CHUNK, entry.size - size))
            if not chunk:
                raise LocalFileCorrupt(str(path), f"{size} bytes, the manifest says {entry.size}")
            if bucket is not None:
                sent.throttled_s += bucket.take(len(chunk))
            crc = checksums.crc64nvme(chunk, crc)
            size += len(chunk)
            if size == entry.size:
                _check_local(path, f, crc, entry)
            yield chunk
            if progress is not None:
                progress(len(chunk))
        if entry.size == 0:
            _check_local(path, f, crc, entry)


def _check_local(path: Path, f: Any, crc: int, entry: FileEntry) -> None:
    if f.read(1):
        raise LocalFileCorrupt(str(path), f"longer than the manifest's {entry.size} bytes")
    if checksums.encode(crc) != entry.checksum:
        raise LocalFileCorrupt(
            str(path), f"crc64nvme {checksums.encode(crc)}, the manifest says {entry.checksum}"
        )


# --- one call, one client -------------------------------------------------------------------------


def push_part(
    hot_step_dir: str | os.PathLike[str],
    manifest: Manifest,
    owner_part: int,
    peer_url: str,
    secret: PeerSecret | str,
    bandwidth_bytes_per_s: float | None = None,
    **options: Any,
) -> PushResult:
    """:meth:`PeerClient.push_part` over a client of its own (``options``: ``bucket``,
    ``progress``, and the client's ``timeout_s``, ``connect_timeout_s``, ``retries``, ``backoff_s``)."""
    client_options = {
        k: options.pop(k) for k in ("timeout_s", "connect_timeout_s", "retries", "backoff_s") if k in options
    }
    with PeerClient(peer_url, secret, **client_options) as client:
        return client.push_part(hot_step_dir, manifest, owner_part, bandwidth_bytes_per_s, **options)


def fetch_part(
    peer_url: str,
    secret: PeerSecret | str,
    run: str,
    step: int,
    owner_part: PartId,
    entries: list[FileEntry],
    dest_dir: str | os.PathLike[str],
    progress: Progress | None = None,
    **client_options: Any,
) -> TransferResult:
    """:meth:`PeerClient.fetch_part` over a client of its own."""
    with PeerClient(peer_url, secret, **client_options) as client:
        return client.fetch_part(run, step, owner_part, entries, dest_dir, progress)


def quarantine_replica(
    peer_url: str, secret: PeerSecret | str, run: str, step: int, owner_part: PartId, reason: str
) -> str:
    """:meth:`PeerClient.quarantine_replica` over a client of its own."""
    with PeerClient(peer_url, secret) as client:
        return client.quarantine_replica(run, step, owner_part, reason)


def list_replicas(peer_url: str, secret: PeerSecret | str, run: str | None = None) -> list[HeldReplica]:
    with PeerClient(peer_url, secret) as client:
        return client.list_replicas(run)


def delete_replica(peer_url: str, secret: PeerSecret | str, run: str, step: int, owner_part: PartId) -> bool:
    with PeerClient(peer_url, secret) as client:
        return client.delete_replica(run, step, owner_part)
