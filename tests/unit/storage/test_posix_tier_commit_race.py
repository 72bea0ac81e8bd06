"""Two nodes copy their parts into one incoming directory; the second to finish publishes it while
the first is still between its last file and its flush. The first must not fail: its files are
published, and the flush it still owes the filesystem does not need the incoming directory."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ckptflow.storage import checksums, posix_tier
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.posix_tier import PosixTier

RUN, STEP = "race", 4


def _source(root: Path) -> tuple[Path, Manifest]:
    directory = root / RUN / f"step-{STEP}"
    directory.mkdir(parents=True)
    entries = []
    for node, name in enumerate(["__0_0.distcp", "__1_0.distcp"]):
        data = os.urandom(50_000)
        (directory / name).write_bytes(data)
        entries.append(FileEntry(name, len(data), checksums.checksum_bytes(data), rank=node, node=node))
    manifest = Manifest(RUN, STEP, 2, "save-race", tuple(entries))
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    return directory, manifest


def test_a_node_whose_part_another_node_published_before_its_flush_succeeds(tmp_path, monkeypatch):
    source, manifest = _source(tmp_path / "hot")
    tier = PosixTier("warm", tmp_path / "warm", workers=1)
    real_syncfs = posix_tier.syncfs
    node_a = threading.current_thread()
    published = threading.Event()

    def syncfs_after_the_other_publishes(path: Path) -> None:
        if threading.current_thread() is node_a:
            # Node A's files are all in place; node B copies its part and publishes meanwhile.
            def node_b() -> None:
                tier.put_files(source, manifest, ["__1_0.distcp"], batch=0)
                tier.commit(source, manifest)
                published.set()

            other = threading.Thread(target=node_b)
            other.start()
            other.join(30)
            assert published.is_set(), "node B could not publish"
        real_syncfs(path)

    monkeypatch.setattr(posix_tier, "syncfs", syncfs_after_the_other_publishes)
    result = tier.put_files(source, manifest, ["__0_0.distcp"], batch=0)
    assert result.files == 1
    assert tier.read_manifest(RUN, STEP) == manifest
    assert tier.verify(RUN, STEP).ok
