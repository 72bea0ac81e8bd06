"""Publishing a checkpoint: the one sequence every writer uses, on every tier, and its reverse.

Every commit in ckptflow (a rank group's checkpoint, a node's part, a multi-node decision, a copy on
warm, a download from S3, a peer replica, an imported DCP checkpoint) goes through :func:`publish`,
so the order is decided here once:

1. files that must not be published are removed (writer locks, half-received temporaries);
2. the data is made durable (the caller's files fsynced, or the caller's own durability step);
3. the files written beside the data (``.metadata``, ``PART.json``) and then the manifest, last,
   each written atomically and durably (:func:`seal`);
4. the directory itself is fsynced (its entries are durable);
5. a manifest-less ``step-N/`` in the way is moved aside (:func:`make_room`): it is no checkpoint;
6. the rename into place, made durable by fsyncing the parent (:func:`publish_dir`).

A reader therefore sees a directory under its final name only whole and durable, and a manifest
only in a directory whose every file is. Two checks come before it: the manifest a caller passes is
the one in its source directory (:func:`source_manifest`: what is checked is what gets published),
and a place that already holds the step holds exactly those manifest bytes (:func:`committed_same`:
a committed checkpoint is never overwritten by another). The reverse, :func:`retire`, removes a
directory so that a crash never leaves half of it under its name.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ckptflow.storage import layout
from ckptflow.storage.atomic import fsync_path, fsync_tree, write_file_atomic
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


def seal(directory: Path, manifest: bytes | None, beside: Sequence[tuple[str, bytes]] = ()) -> None:
    """Steps 3 and 4: write each ``(name, bytes)`` of ``beside``, then ``manifest`` (last; None: a
    node's part before its decision), each atomically and durably, and fsync ``directory``.

    Also used on its own where a published directory gets its decision in place (a node's part
    made a checkpoint by the multi-node decision, a node that restores a step it lacked the
    decision files of)."""
    for name, data in beside:
        write_file_atomic(directory / name, data)
    if manifest is not None:
        write_file_atomic(directory / MANIFEST_NAME, manifest)
    fsync_path(directory)


def publish(
    partial: Path,
    final: Path,
    manifest: bytes | None,
    *,
    beside: Sequence[tuple[str, bytes]] = (),
    unpublished: Sequence[str] = (layout.LOCK_PREFIX,),
    leftovers: Iterable[Path] = (),
    fsync_files: bool = False,
    make_durable: Callable[[], None] | None = None,
    replace_manifestless: bool = False,
    on_sealed: Callable[[], None] | None = None,
) -> bool:
    """Make ``partial`` (every data file written) the checkpoint ``final``, in the order of the
    module docstring.

    Args:
        manifest: the manifest's exact bytes, written last; None for a node's part (``PART.json``
            in ``beside``), which the decision completes later (:func:`seal`).
        beside: files written before the manifest, in order.
        unpublished: names in ``partial`` (its top level) starting with one of these are removed.
        leftovers: more paths to remove first (anywhere in ``partial``).
        fsync_files: fsync every file and directory under ``partial`` (files written without their
            own fsync: copies, downloads); otherwise ``make_durable``, if given, does the caller's.
        replace_manifestless: move a manifest-less ``final`` aside first (:func:`make_room`).
        on_sealed: called once everything is durable in ``partial``, before the rename (a save's
            "rename" phase, where crash tests kill it).

    Returns False, leaving ``partial`` sealed in place, if ``final`` exists (:func:`publish_dir`);
    the caller decides what that means. ``OSError`` from any step propagates.
    """
    for path in leftovers:
        path.unlink(missing_ok=True)
    for name in os.listdir(partial):
        if name.startswith(tuple(unpublished)):
            (partial / name).unlink()
    if fsync_files:
        fsync_tree(partial)
    elif make_durable is not None:
        make_durable()
    seal(partial, manifest, beside)
    if on_sealed is not None:
        on_sealed()
    if replace_manifestless:
        make_room(final)
    return publish_dir(partial, final)


def make_room(final: Path) -> bool:
    """Before publishing ``final``: a directory there without a manifest is not a checkpoint (what a
    killed delete left, or an undecided part of an earlier attempt), so it is removed
    (:func:`retire`) instead of making the publish give up. A directory with a manifest is never
    touched. True if something was moved out of the way."""
    if not final.is_dir() or (final / MANIFEST_NAME).is_file():
        return False
    try:
        retire(final)
    except FileNotFoundError:  # gone already (someone else made room): nothing to do
        return False
    return True


def publish_dir(partial: str | os.PathLike[str], final: str | os.PathLike[str]) -> bool:
    """Rename a fully written, fsynced directory to its final name and make the rename durable.

    Returns False, leaving ``partial`` in place, if ``final`` already exists: a committed directory
    is never replaced or written into.
    """
    final_path = Path(final)
    try:
        # os.rename onto an existing *empty* directory would succeed on Linux; refuse any existing.
        if final_path.exists():
            return False
        os.rename(partial, final_path)
    except (FileExistsError, OSError) as exc:
        if final_path.exists():
            return False
        raise exc
    fsync_path(final_path.parent)
    return True


def retire(directory: Path, *, manifest_first: bool = False, strict: bool = True) -> Path:
    """Remove ``directory`` atomically for readers: with ``manifest_first``, its manifest is removed
    (and the removal made durable) first, so a reader that still finds the directory finds no
    checkpoint; then it is renamed aside to ``<name>.deleting-<id>`` (one rename, made durable) and
    removed. A crash at any moment leaves it whole under its name, manifest-less (which publishing
    and restore clean-up treat as no checkpoint), or under a ``.deleting-`` name that clean-up
    finishes: never a half-removed ``step-N``. ``strict=False`` ignores errors of the final removal
    (what is left is already out of every reader's way). Returns the name it was removed under."""
    if manifest_first:
        (directory / MANIFEST_NAME).unlink(missing_ok=True)
        fsync_path(directory)
    doomed = directory.with_name(f"{directory.name}.deleting-{secrets.token_hex(4)}")
    os.rename(directory, doomed)
    fsync_path(directory.parent)
    shutil.rmtree(doomed, ignore_errors=not strict)
    return doomed
