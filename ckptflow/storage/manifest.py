"""The manifest: the contract between the training side and every storage tier.

``manifest.json`` lists every file of a checkpoint with its size and CRC64NVME, plus the step,
world size, metrics and versions. It is written last, after every file is durable; a directory
without a valid manifest is not a checkpoint. Every tier is verified against it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ckptflow.storage import checksums

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "ckptflow.manifest"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = frozenset({1})


class ManifestError(ValueError):
    """A manifest that cannot be trusted: unreadable, malformed, unknown version or unsafe path."""


class UnsupportedManifestError(ManifestError):
    """A well-formed manifest of a format version this ckptflow cannot read (not corruption)."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the checkpoint directory, size, checksum."""

    path: str
    size: int
    checksum: str
    rank: int = 0


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

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

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
            "files": [asdict(f) for f in self.files],
            "metrics": self.metrics,
            "stats": self.stats,
            "versions": self.versions,
        }
        return (json.dumps(body, indent=1, sort_keys=False, allow_nan=False) + "\n").encode()


def safe_relative_path(path: object, where: str) -> str:
    """Validate a manifest file path: relative, no '..', no absolute or backslash tricks."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where}: file path must be a non-empty string, got {path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute() or "\\" in path or any(part in ("..", "") for part in path.split("/")):
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

    Results are cached by (bytes, where): every batch task of a promotion reads the same manifest,
    and validating a 1,024-file manifest costs ~40 ms each time. A Manifest is frozen and treated
    as read-only everywhere, so sharing one is safe; errors are never cached.
    """
    return _parse_cached(bytes(data), where)


@functools.lru_cache(maxsize=16)
def _parse_cached(data: bytes, where: str) -> Manifest:
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
        files.append(FileEntry(path=path, size=size, checksum=checksum, rank=int(raw.get("rank", 0))))
    metrics = body.get("metrics", {})
    if not isinstance(metrics, dict):
        raise ManifestError(f"{where}: field 'metrics' must be an object")
    return Manifest(
        run=_require(body, "run", str, where),
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
    )


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
