"""Checkpoints on disk for the peer transport tests: real files, real CRCs, a real manifest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ckptflow.peer import replica_entries
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, NodePart

SECRET = "peer-test-secret-Never-Printed-3f9c1a"
RUN = "run-1"
STEP = 5


@dataclass
class Checkpoint:
    manifest: Manifest
    data: dict[str, bytes]

    def write_node(self, hot_root: Path, node: int) -> Path:
        """Node ``node``'s hot ``step-N/`` after the decision: its part, .metadata, the manifest."""
        directory = hot_root / self.manifest.run / f"step-{self.manifest.step}"
        directory.mkdir(parents=True, exist_ok=True)
        for entry in replica_entries(self.manifest, node):
            (directory / entry.path).parent.mkdir(parents=True, exist_ok=True)
            (directory / entry.path).write_bytes(self.data[entry.path])
        (directory / MANIFEST_NAME).write_bytes(self.manifest.to_json())
        return directory

    def part_bytes(self, node: int) -> int:
        return sum(e.size for e in replica_entries(self.manifest, node))


def make_checkpoint(
    nodes: int = 2, files_per_node: int = 2, size: int = 1 << 20, step: int = STEP
) -> Checkpoint:
    """A checkpoint of ``nodes`` nodes, each file in two blocks (as DCP items), random bytes."""
    data: dict[str, bytes] = {}
    files: list[FileEntry] = []
    for node in range(nodes):
        for i in range(files_per_node):
            rank = node * files_per_node + i
            path = f"__{rank}_0.distcp"
            body = os.urandom(size + 1000 * rank)
            half = len(body) // 2
            blocks = (
                (0, half, checksums.checksum_bytes(body[:half])),
                (half, len(body) - half, checksums.checksum_bytes(body[half:])),
            )
            data[path] = body
            files.append(FileEntry(path, len(body), checksums.checksum_bytes(body), rank, node, blocks))
    metadata = os.urandom(2000)
    data[".metadata"] = metadata
    files.append(FileEntry(".metadata", len(metadata), checksums.checksum_bytes(metadata), 0, 0))
    parts = tuple(
        NodePart(n, f"host-{n}", tuple(range(n * files_per_node, (n + 1) * files_per_node)))
        for n in range(nodes)
    )
    manifest = Manifest(
        run=RUN,
        step=step,
        world_size=nodes * files_per_node,
        save_id=f"test-{step}-1",
        files=tuple(files),
        nodes=parts,
    )
    return Checkpoint(manifest, data)


def tree(root: Path) -> list[str]:
    """Every path under ``root`` (relative), sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))
