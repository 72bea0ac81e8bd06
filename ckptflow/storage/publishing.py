"""Publishing a checkpoint, the same way on every tier and by every writer.

Two checks before anything is written: the manifest a caller passes is the one in its source
directory (what is checked is what gets published), and a tier that already holds the step holds
exactly those manifest bytes (a committed checkpoint is never overwritten by another). Then one way to
turn a directory whose files are all written into a checkpoint: the manifest's exact bytes last, the
files that must not be published (writer locks, half-copied temporaries) removed, the directory
fsynced, a manifest-less ``step-N/`` moved aside, the rename made durable (:func:`seal_and_publish`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ckptflow.storage import layout
from ckptflow.storage.atomic import fsync_path, fsync_tree, publish_dir, write_file_atomic
from ckptflow.storage.manifest import MANIFEST_NAME, Manifest, ManifestError, parse_manifest
from ckptflow.storage.tier import TierError


def source_manifest(tier: str, source: Path, manifest: Manifest, verb: str) -> bytes:
    """The exact bytes of ``source``'s manifest.json, which must be ``manifest``; ``TierError`` naming
    ``tier`` and what it could not do (``verb``: copy, upload) otherwise."""
    try:
        data = (source / MANIFEST_NAME).read_bytes()
        same = parse_manifest(data, where=str(source / MANIFEST_NAME)) == manifest
    except (OSError, ManifestError) as exc:
        raise TierError(f"{tier}: cannot {verb} {source}: {exc}") from exc
    if not same:
        raise TierError(f"{tier}: {source}/{MANIFEST_NAME} is not the manifest passed in")
    return data


def committed_same(tier: str, where: str, step: int, committed: bytes | None, manifest_bytes: bytes) -> bool:
    """True if the tier's copy at ``where`` is committed with exactly ``manifest_bytes`` (``committed``:
    its manifest's bytes, None if it has none); ``TierError`` if it holds another checkpoint."""
    if committed is None:
        return False
    if committed != manifest_bytes:
        raise TierError(
            f"{tier}: {where} already holds a different checkpoint for step {step} (manifest differs); "
            "refusing to overwrite a committed checkpoint"
        )
    return True


def seal_and_publish(
    partial: Path,
    final: Path,
    manifest_bytes: bytes,
    *,
    unpublished: Sequence[str] = (layout.LOCK_PREFIX,),
    fsync_files: bool = False,
    make_room: bool = False,
) -> bool:
    """Make ``partial`` (every file written) the checkpoint ``final``: write ``manifest_bytes`` as its
    manifest (last, atomically, durably), remove the files whose names start with one of
    ``unpublished``, fsync the directory (and every file in it with ``fsync_files``: files written
    without their own fsync), with ``make_room`` move a manifest-less ``final`` aside
    (:func:`layout.make_room`), then rename and make the rename durable.

    False, leaving ``partial`` sealed in place, if ``final`` exists (``publish_dir``'s contract); the
    caller decides what that means. ``OSError`` from any step propagates.
    """
    write_file_atomic(partial / MANIFEST_NAME, manifest_bytes)
    for name in os.listdir(partial):
        if name.startswith(tuple(unpublished)):
            (partial / name).unlink()
    if fsync_files:
        fsync_tree(partial)
    else:
        fsync_path(partial)
    if make_room:
        layout.make_room(final)
    return publish_dir(partial, final)
