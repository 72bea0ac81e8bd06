"""The manifest: the contract between the training side and every storage tier.

``manifest.json`` lists every file of a checkpoint with its size and CRC64NVME, plus the step,
world size, metrics and versions. It is written last, after every file is durable; a directory
without a valid manifest is not a checkpoint. Every tier is verified against it.

Format 2 (written since multi-node support; format 1 still reads) adds what node-local storage and
read-once verification need:

- ``nodes``: the nodes of the job at save time (index, host, ranks). Each node's hot root holds its
  *part*: the files whose ``node`` is its index (plus ``.metadata`` and the manifest itself).
- per file ``blocks``: ``[offset, length, crc]`` spans (one per DCP item) whose CRCs combine into the
  file's; a restore that reads only some items of a file verifies exactly the bytes it reads.
- ``alternates``: items a node wrote a copy of although another node's copy is the one DCP's
  ``.metadata`` points to (replicated tensors are written once *per node*, so every node's part is
  enough to restore that node's ranks without reading another node's disk).

The manifest checks itself: ``digest`` is the CRC64NVME of its canonical JSON without that field
(keys sorted, no whitespace), so a changed digit in a metric, the step or the run makes it a
:class:`ManifestError` wherever it is read (:func:`parse_manifest` checks it; manifests written
before the field existed carry none and still parse). The canonical form, not the file's bytes, is
hashed, so the check holds whatever whitespace the file has; the file's bytes have their own CRC,
the ``manifest_checksum`` the catalog records.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptflow.storage import checksums
from ckptflow.storage.run_names import check_run_name

MANIFEST_NAME = "manifest.json"
DIGEST_FIELD = "digest"
FORMAT_NAME = "ckptflow.manifest"
FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2})


class ManifestError(ValueError):
    """A manifest that cannot be trusted: unreadable, malformed, unknown version or unsafe path."""


class UnsupportedManifestError(ManifestError):
    """A well-formed manifest of a format version this ckptflow cannot read (not corruption)."""


Block = tuple[int, int, str]  # (offset, length, encoded CRC64NVME) of a span of one file


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the checkpoint directory, size, checksum, the
    rank that wrote it and the node whose part it belongs to (both as at save time), and the CRCs
    of its blocks (format 2; empty for ``.metadata`` and for format-1 manifests)."""

    path: str
    size: int
    checksum: str
    rank: int = 0
    node: int = 0
    blocks: tuple[Block, ...] = ()

    def block(self, offset: int, length: int) -> str | None:
        """The CRC of the block ``[offset, offset + length)``, or None if no block is that span."""
        for block_offset, block_length, crc in self.blocks:
            if block_offset == offset and block_length == length:
                return crc
        return None


@dataclass(frozen=True)
class NodePart:
    """One node of the job at save time: its index, host name and ranks."""

    node: int
    host: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Alternate:
    """Another copy of a DCP item: ``fqn`` and chunk ``offset`` name the item (as DCP's
    ``MetadataIndex`` does), ``file``/``file_offset``/``length`` say where this copy lies."""

    fqn: str
    offset: tuple[int, ...] | None
    file: str
    file_offset: int
    length: int


@dataclass(frozen=True)
class Manifest:
    """Everything a tier needs to know to prove a checkpoint is whole."""

    run: str
    step: int
    world_size: int
    save_id: str
    files: tuple[FileEntry, ...]
    metrics: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    created_at: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = checksums.ALGORITHM
    nodes: tuple[NodePart, ...] = ()
    alternates: tuple[Alternate, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, path: str) -> FileEntry | None:
        """The entry of ``path``, or None if the checkpoint has no such file."""
        for entry in self.files:
            if entry.path == path:
                return entry
        return None

    def part_files(self, node: int) -> list[FileEntry]:
        """The files of node ``node``'s part (as at save time)."""
        return [f for f in self.files if f.node == node]

    def part_bytes(self, node: int) -> int:
        return sum(f.size for f in self.part_files(node))

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "run": self.run,
            "step": self.step,
            "world_size": self.world_size,
            "save_id": self.save_id,
            "created_at": self.created_at,
            "checksum_algorithm": self.checksum_algorithm,
            "files": [_file_json(f, self.format_version) for f in self.files],
            "metrics": self.metrics,
            "stats": self.stats,
            "versions": self.versions,
        }
        if self.format_version >= 2:
            body["nodes"] = [{"node": n.node, "host": n.host, "ranks": list(n.ranks)} for n in self.nodes]
            body["alternates"] = [
                {
                    "fqn": a.fqn,
                    "offset": None if a.offset is None else list(a.offset),
                    "file": a.file,
                    "file_offset": a.file_offset,
                    "length": a.length,
                }
                for a in self.alternates
            ]
        body[DIGEST_FIELD] = content_digest(body)
        return (json.dumps(body, indent=1, sort_keys=False, allow_nan=False) + "\n").encode()


def content_digest(body: dict[str, Any]) -> str:
    """CRC64NVME of ``body``'s canonical JSON (sorted keys, no whitespace, ASCII), ``digest`` left out."""
    content = {k: v for k, v in body.items() if k != DIGEST_FIELD}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return checksums.checksum_bytes(canonical.encode())


def _file_json(entry: FileEntry, version: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "path": entry.path,
        "size": entry.size,
        "checksum": entry.checksum,
        "rank": entry.rank,
    }
    if version >= 2:
        out["node"] = entry.node
        if entry.blocks:
            out["blocks"] = [list(b) for b in entry.blocks]
    return out


def safe_relative_path(path: object, where: str) -> str:
    """Validate a manifest file path: relative, no '..', no absolute or backslash tricks."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where}: file path must be a non-empty string, got {path!r}")
    # String tests, not PurePosixPath: a 1,024-file manifest checks 1,024 paths on every parse.
    if path.startswith("/") or "\\" in path or any(part in ("..", "") for part in path.split("/")):
        raise ManifestError(
            f"{where}: file path {path!r} points outside the checkpoint directory; "
            "manifest paths must be relative and must not contain '..'"
        )
    if path == MANIFEST_NAME:
        raise ManifestError(f"{where}: the manifest cannot list itself")
    return path


def _require(body: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in body:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = body[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"{where}: field {key!r} has type {type(value).__name__}, expected {kind}")
    return value


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate manifest bytes; ``where`` names the source in every error.

    Results are cached by the bytes alone: every batch task of a promotion reads the same manifest,
    each tier's copy of a checkpoint holds the same bytes, and validating a 1,024-file manifest costs
    ~10 ms each time. ``where`` only names the source in an error, and errors are never cached. A
    Manifest is frozen and treated as read-only everywhere, so sharing one is safe.
    """
    data = bytes(data)
    with _parsed_lock:
        cached = _parsed.get(data)
        if cached is not None:
            _parsed.move_to_end(data)
            return cached
    manifest = _parse(data, where)
    with _parsed_lock:
        _parsed[data] = manifest
        while len(_parsed) > _PARSED_KEPT:
            _parsed.popitem(last=False)
    return manifest


_PARSED_KEPT = 16  # manifests whose parse is kept (least recently used dropped first)
_parsed: OrderedDict[bytes, Manifest] = OrderedDict()
_parsed_lock = threading.Lock()


def _parse(data: bytes, where: str) -> Manifest:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise ManifestError(f"{where}: not a ckptflow manifest (field 'format' must be {FORMAT_NAME!r})")
    version = _require(body, "format_version", int, where)
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise UnsupportedManifestError(
            f"{where}: manifest format_version {version} is not supported by this ckptflow "
            f"(supported: {sorted(SUPPORTED_FORMAT_VERSIONS)}); upgrade ckptflow to read it"
        )
    _check_digest(body, where)  # after the version: a newer format may seal itself otherwise
    algorithm = _require(body, "checksum_algorithm", str, where)
    if algorithm != checksums.ALGORITHM:
        raise ManifestError(f"{where}: checksum_algorithm {algorithm!r} unsupported (expected crc64nvme)")
    step = _require(body, "step", int, where)
    world = _require(body, "world_size", int, where)
    if step < 0 or world < 1:
        raise ManifestError(f"{where}: step must be >= 0 and world_size >= 1 (got {step}, {world})")
    files: list[FileEntry] = []
    seen: set[str] = set()
    for i, raw in enumerate(_require(body, "files", list, where)):
        loc = f"{where}: files[{i}]"
        if not isinstance(raw, dict):
            raise ManifestError(f"{loc}: expected an object")
        path = safe_relative_path(raw.get("path"), loc)
        if path in seen:
            raise ManifestError(f"{loc}: duplicate path {path!r}")
        seen.add(path)
        size = _require(raw, "size", int, loc)
        if size < 0:
            raise ManifestError(f"{loc}: size must be >= 0, got {size}")
        checksum = _require(raw, "checksum", str, loc)
        if not checksums.is_well_formed(checksum):
            raise ManifestError(f"{loc}: checksum {checksum!r} is not a base64 CRC64NVME")
        files.append(
            FileEntry(
                path=path,
                size=size,
                checksum=checksum,
                rank=_optional_int(raw, "rank", loc),
                node=_optional_int(raw, "node", loc),
                blocks=_parse_blocks(raw.get("blocks", []), size, loc),
            )
        )
    nodes = _parse_nodes(body.get("nodes", []), where)
    alternates = _parse_alternates(body.get("alternates", []), {f.path: f for f in files}, where)
    metrics = body.get("metrics", {})
    if not isinstance(metrics, dict):
        raise ManifestError(f"{where}: field 'metrics' must be an object")
    run = _require(body, "run", str, where)
    try:
        check_run_name(run, f"{where}: field 'run'")
    except ValueError as exc:  # a manifest naming '../x' must never become a tier path
        raise ManifestError(str(exc)) from None
    return Manifest(
        run=run,
        step=step,
        world_size=world,
        save_id=_require(body, "save_id", str, where),
        files=tuple(files),
        metrics={str(k): float(v) for k, v in metrics.items() if isinstance(v, int | float)},
        versions={str(k): str(v) for k, v in dict(body.get("versions", {})).items()},
        created_at=str(body.get("created_at", "")),
        stats={str(k): float(v) for k, v in dict(body.get("stats", {})).items()},
        format_version=version,
        checksum_algorithm=algorithm,
        nodes=nodes,
        alternates=alternates,
    )


def _check_digest(body: dict[str, Any], where: str) -> None:
    if DIGEST_FIELD not in body:
        return  # written before manifests carried a digest: the file's CRC in the catalog still holds
    recorded = body[DIGEST_FIELD]
    if not isinstance(recorded, str) or not checksums.is_well_formed(recorded):
        raise ManifestError(f"{where}: field {DIGEST_FIELD!r} must be a base64 CRC64NVME, got {recorded!r}")
    try:
        actual = content_digest(body)
    except ValueError as exc:  # NaN or an overflowing number: not what to_json writes
        raise ManifestError(f"{where}: content cannot be checked against its digest ({exc})") from None
    if actual != recorded:
        raise ManifestError(
            f"{where}: the manifest was changed after it was written: its content has digest {actual}, "
            f"its {DIGEST_FIELD!r} field says {recorded}; it cannot be trusted (restore it from another "
            "tier, or quarantine the checkpoint)"
        )


def _optional_int(raw: dict[str, Any], key: str, where: str) -> int:
    value = raw.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{where}: field {key!r} must be an integer >= 0, got {value!r}")
    return value


def _parse_blocks(raw: object, size: int, where: str) -> tuple[Block, ...]:
    if not isinstance(raw, list):
        raise ManifestError(f"{where}: field 'blocks' must be a list of [offset, length, crc]")
    blocks: list[Block] = []
    for i, block in enumerate(raw):
        ok = isinstance(block, list) and len(block) == 3
        if ok:
            offset, length, crc = block
            ok = (
                all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length))
                and offset >= 0
                and length >= 0
                and offset + length <= size
                and checksums.is_well_formed(crc)
            )
        if not ok:
            raise ManifestError(
                f"{where}: blocks[{i}] must be [offset, length, crc64nvme] inside the file's "
                f"{size} bytes, got {block!r}"
            )
        blocks.append((offset, length, crc))
    return tuple(blocks)


def _parse_nodes(raw: object, where: str) -> tuple[NodePart, ...]:
    if not isinstance(raw, list):
        raise ManifestError(f"{where}: field 'nodes' must be a list")
    nodes: list[NodePart] = []
    for i, node in enumerate(raw):
        loc = f"{where}: nodes[{i}]"
        if not isinstance(node, dict):
            raise ManifestError(f"{loc}: expected an object")
        ranks = node.get("ranks")
        if not isinstance(ranks, list) or not all(isinstance(r, int) and r >= 0 for r in ranks):
            raise ManifestError(f"{loc}: field 'ranks' must be a list of integers >= 0")
        host = node.get("host", "")
        if not isinstance(host, str):
            raise ManifestError(f"{loc}: field 'host' must be a string")
        nodes.append(NodePart(node=_optional_int(node, "node", loc), host=host, ranks=tuple(ranks)))
    return tuple(nodes)


def _parse_alternates(raw: object, files: dict[str, FileEntry], where: str) -> tuple[Alternate, ...]:
    if not isinstance(raw, list):
        raise ManifestError(f"{where}: field 'alternates' must be a list")
    out: list[Alternate] = []
    for i, alt in enumerate(raw):
        loc = f"{where}: alternates[{i}]"
        if not isinstance(alt, dict):
            raise ManifestError(f"{loc}: expected an object")
        fqn = _require(alt, "fqn", str, loc)
        offset = alt.get("offset")
        if offset is not None and not (isinstance(offset, list) and all(isinstance(v, int) for v in offset)):
            raise ManifestError(f"{loc}: field 'offset' must be null or a list of integers")
        path = _require(alt, "file", str, loc)
        entry = files.get(path)
        file_offset = _require(alt, "file_offset", int, loc)
        length = _require(alt, "length", int, loc)
        if entry is None or file_offset < 0 or length < 0 or file_offset + length > entry.size:
            raise ManifestError(f"{loc}: {path!r} [{file_offset}, +{length}) is not a span of a listed file")
        out.append(Alternate(fqn, None if offset is None else tuple(offset), path, file_offset, length))
    return tuple(out)


def read_manifest(checkpoint_dir: str | os.PathLike[str]) -> Manifest:
    """Read ``<checkpoint_dir>/manifest.json``; ``ManifestError`` naming the path on any problem."""
    path = Path(checkpoint_dir) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise ManifestError(f"{path}: no manifest; this directory is not a committed checkpoint") from exc
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest ({exc.strerror})") from exc
    return parse_manifest(data, where=str(path))


def manifest_checksum(checkpoint_dir: str | os.PathLike[str]) -> str:
    """CRC64NVME of the manifest file's bytes: the identity of a checkpoint across tiers."""
    return checksums.checksum_file(Path(checkpoint_dir) / MANIFEST_NAME)[0]


def finite_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """Keep numeric metrics as floats; JSON cannot carry NaN/inf, so they become strings elsewhere."""
    out: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        try:
            number = float(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metric {key!r} must be a number, got {type(value).__name__}") from exc
        if not math.isfinite(number):
            # A NaN loss is worth recording, but JSON has no NaN: keep the manifest strict.
            continue
        out[str(key)] = number
    return out
