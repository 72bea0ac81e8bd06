"""Plain functions: build tiers from ``ckptflow.yaml`` and split a checkpoint into file batches."""

from __future__ import annotations

import functools
from pathlib import Path

from ckptflow.policy.config import CkptflowConfig, load_config
from ckptflow.storage.from_config import build_tiers
from ckptflow.storage.manifest import FileEntry, Manifest
from ckptflow.storage.tier import Tier

DEFAULT_MAX_BATCHES = 4  # each batch copies its files on several threads; more tasks only add overhead


def load(config_path: str) -> tuple[CkptflowConfig, dict[str, Tier]]:
    """The config and its tiers, built once per process and config version.

    Building an S3 tier loads boto3's service model (0.2-0.5 s); every task of a flow run would pay
    it again. Tiers are thread-safe (boto3 clients are), so tasks in threads share them.
    """
    path = Path(config_path).resolve()
    return _load_cached(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_cached(config_path: str, _mtime_ns: int) -> tuple[CkptflowConfig, dict[str, Tier]]:
    config = load_config(config_path)
    return config, build_tiers(config)


def file_batches(manifest: Manifest, max_batches: int = DEFAULT_MAX_BATCHES) -> list[list[str]]:
    """Split the files into at most ``max_batches`` groups of similar byte size (largest first).

    One task per batch, not per file: a 1,024-file checkpoint becomes at most ``max_batches`` tasks.
    """
    count = max(1, min(max_batches, len(manifest.files)))
    groups: list[list[FileEntry]] = [[] for _ in range(count)]
    loads = [0] * count
    for entry in sorted(manifest.files, key=lambda e: (-e.size, e.path)):
        smallest = loads.index(min(loads))
        groups[smallest].append(entry)
        loads[smallest] += entry.size
    return [[e.path for e in group] for group in groups if group]


def batches_of(
    manifest: Manifest, paths: list[str], max_batches: int = DEFAULT_MAX_BATCHES
) -> list[list[str]]:
    """:func:`file_batches` over some of the manifest's files (``paths``): what one node copies."""
    wanted = set(paths)
    subset = Manifest(
        run=manifest.run,
        step=manifest.step,
        world_size=manifest.world_size,
        save_id=manifest.save_id,
        files=tuple(e for e in manifest.files if e.path in wanted),
    )
    return file_batches(subset, max_batches) if subset.files else []
