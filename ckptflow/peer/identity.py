"""Which part of a checkpoint a replica is, and where replicas live in a node's hot root.

A part is named by its owner's save-time identity, ``part-<node>-of-<nodes>``: the owner's index
in the manifest's ``nodes`` section and the number of nodes the job had when it saved. Never by
today's rank or host, which change when a job restarts on other machines.

```
<hot root>/<run>/
  step-<N>/                           this node's own part (storage.layout), untouched here
  peers/                              replicas this node holds of other nodes' parts
    part-<k>-of-<n>/                  node k's parts (of an n-node save): a checkpoint root in
                                      storage.layout's format, so layout.scan, quarantine and
                                      remove_stale_partials work on it unchanged
      step-<N>/                       committed replica: node k's files of step N, .metadata, and
                                      the decided manifest.json (written last)
      step-<N>.partial-recv-<id>/     being received; <id> = the manifest's CRC64NVME in hex, so a
                                      rerun of the same push resumes it
        .ckptflow-peer-manifest.json  the manifest being received (commit checks it is the same)
        .ckptflow-peer-recv-<r>-<f>   a file being received; renamed to <f> once verified
        .writer-lock-rank<r>          held while a request writes (layout.writer_lock semantics)
      step-<N>.deleting-<id>/         being removed
      quarantine/step-<N>.<ts>/       failed verification on a fetch (QUARANTINE_REASON.txt)
```

``peers/`` is not a ``step-N`` directory, so a node's own restore inventory
(``layout.scan(<hot root>/<run>)``) never sees replicas unless it looks there on purpose.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ckptflow.storage import layout
from ckptflow.storage.manifest import FileEntry, Manifest
from ckptflow.storage.run_names import check_run_name

# DCP's metadata file (ckptflow.training_hooks.save.writer.METADATA_NAME): listed under node 0, but every
# decided part holds a copy, so a replica of any part holds one too.
PEERS_DIR = "peers"
RESERVED_PREFIX = ".ckptflow-peer-"  # names of the transport's own files in a partial directory
_PART = re.compile(r"^part-(\d{1,6})-of-(\d{1,6})$")


@dataclass(frozen=True, order=True)
class PartId:
    """Node ``node``'s part of a checkpoint saved by ``nodes`` nodes."""

    node: int
    nodes: int

    def __post_init__(self) -> None:
        if not (isinstance(self.nodes, int) and self.nodes >= 1):
            raise ValueError(f"PartId.nodes must be an integer >= 1, got {self.nodes!r}")
        if not (isinstance(self.node, int) and 0 <= self.node < self.nodes):
            raise ValueError(f"PartId.node must be an integer in [0, {self.nodes}), got {self.node!r}")

    @property
    def name(self) -> str:
        return f"part-{self.node}-of-{self.nodes}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> PartId:
        """``part-1-of-4`` -> PartId(1, 4); ValueError naming the expected form otherwise."""
        match = _PART.match(name) if isinstance(name, str) else None
        if match is None:
            raise ValueError(
                f"{name!r} is not a part name; expected part-<node>-of-<nodes>, e.g. part-1-of-4"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    @classmethod
    def of(cls, manifest: Manifest, node: int) -> PartId:
        """The id of node ``node``'s part of ``manifest``'s checkpoint; ValueError if the
        manifest's save had no such node. A manifest without a ``nodes`` section (one node, or
        format 1) has one part, node 0's."""
        indices = sorted(n.node for n in manifest.nodes) or [0]
        if node not in indices:
            raise ValueError(
                f"owner_part: step {manifest.step} of run {manifest.run!r} was saved by nodes {indices}; "
                f"it has no part of node {node!r}"
            )
        return cls(node, len(indices))


def replica_entries(manifest: Manifest, node: int) -> list[FileEntry]:
    """The files a replica of node ``node``'s part holds, in manifest order: the files of that
    part and ``.metadata``. One node's save: every file."""
    PartId.of(manifest, node)  # validates node
    return [f for f in manifest.files if f.node == node or f.path == layout.METADATA_NAME]


def reserved(path: str) -> bool:
    """True if a manifest path would collide with the transport's own files in a partial dir."""
    name = path.rsplit("/", 1)[-1]
    return name.startswith(RESERVED_PREFIX) or name.startswith(layout.LOCK_PREFIX)


def peers_root(hot_root: Path, run: str) -> Path:
    """``<hot root>/<run>/peers``: every replica this node holds for run ``run``."""
    return Path(hot_root) / check_run_name(run) / PEERS_DIR


def replica_root(hot_root: Path, run: str, part: PartId) -> Path:
    """``<hot root>/<run>/peers/part-<k>-of-<n>``: a checkpoint root (storage.layout format)."""
    return peers_root(hot_root, run) / part.name


def replica_dir(hot_root: Path, run: str, step: int, part: PartId) -> Path:
    """Where the committed replica of ``part`` of (run, step) lives on this node."""
    return replica_root(hot_root, run, part) / layout.committed_name(step)
