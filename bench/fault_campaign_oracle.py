"""The fault campaign's operator view (bench/fault_campaign.py): what the disks hold, which step the job
must resume from, and whether the catalog agrees with the disks. Computed from the backing directories
of every node's disk and the warm directory (only the operator may look at all of them), by reading
the manifests and checksumming the files itself, never from the product's answer.

A *copy* of a step is a directory that holds some of its files for one save (one ``save_id``):

- a node's own ``<disk>/<run>/step-N/``: decided (its ``manifest.json``) or a committed part whose
  decision was not written there yet (``PART.json`` only: the decision may stand elsewhere);
- a peer replica ``<disk>/<run>/peers/part-<k>-of-<n>/step-N/`` (with its manifest);
- warm's ``<warm>/<run>/step-N/`` (published: with its manifest).

A save is *committed* when its manifest is in some copy (the coordinator writes a manifest only for
a committed decision). It is *restorable* when, for every file its manifest lists, some copy of the
same save holds that file with the manifest's size and CRC64NVME, readable (a file the campaign makes
fail with EIO does not count). The job must resume from the newest restorable step (0: none).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptflow.catalog import Catalog, CheckpointState
from ckptflow.storage import checksums

RUN = "main"
PEERS = "peers"
QUARANTINE = "quarantine"


@dataclass(frozen=True)
class Copy:
    """One directory holding files of one save of one step."""

    where: str  # "node0", "node0 peers/part-1-of-2", "warm"
    step: int
    save_id: str
    directory: Path
    manifest: dict[str, Any] | None  # the parsed manifest.json, None for a part without one


def _step_of(name: str) -> int | None:
    if name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        body = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _copy_at(where: str, directory: Path, parts_count: bool) -> Copy | None:
    step = _step_of(directory.name)
    if step is None or not directory.is_dir():
        return None
    manifest = _read_json(directory / "manifest.json")
    if manifest is not None and isinstance(manifest.get("save_id"), str):
        return Copy(where, step, manifest["save_id"], directory, manifest)
    part = _read_json(directory / "PART.json") if parts_count else None
    if part is not None and isinstance(part.get("save_id"), str):
        return Copy(where, step, part["save_id"], directory, None)
    return None


def copies(disks: dict[str, Path], warm: Path | None) -> list[Copy]:
    """Every copy on the disks (``host -> backing directory`` of its hot root) and on warm."""
    found: list[Copy] = []
    for host, disk in sorted(disks.items()):
        run_dir = disk / RUN
        for child in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
            copy = _copy_at(host, child, parts_count=True)
            if copy is not None:
                found.append(copy)
        peers = run_dir / PEERS
        for part_dir in sorted(peers.iterdir()) if peers.is_dir() else []:
            for child in sorted(part_dir.iterdir()) if part_dir.is_dir() else []:
                copy = _copy_at(f"{host} {PEERS}/{part_dir.name}", child, parts_count=False)
                if copy is not None and copy.manifest is not None:
                    found.append(copy)
    if warm is not None and (warm / RUN).is_dir():
        for child in sorted((warm / RUN).iterdir()):
            copy = _copy_at("warm", child, parts_count=False)
            if copy is not None and copy.manifest is not None:
                found.append(copy)
    return found


def _intact(path: Path, size: int, checksum: str, unreadable: set[Path]) -> bool:
    if path in unreadable:
        return False
    try:
        crc, got = checksums.checksum_file(path)
    except OSError:
        return False
    return got == size and crc == checksum


@dataclass(frozen=True)
class Survey:
    """What the disks hold at one moment, judged by the operator."""

    copies: list[Copy]
    committed: dict[tuple[int, str], dict[str, Any]]  # (step, save_id) -> its manifest
    restorable: dict[int, str]  # step -> the save_id whose every file survives
    missing: dict[tuple[int, str], str]  # committed but not restorable: the first file lacking

    @property
    def newest(self) -> int:
        return max(self.restorable, default=0)

    def describe(self) -> str:
        steps = sorted({s for s, _ in self.committed})
        return ", ".join(f"{s}{'' if s in self.restorable else '(lost)'}" for s in steps) or "nothing"


def survey(disks: dict[str, Path], warm: Path | None, unreadable: Iterable[Path] = ()) -> Survey:
    """Which committed saves survive whole on the disks and warm (``unreadable``: files that fail to
    read, e.g. the one the campaign makes fail with EIO)."""
    bad = {Path(p) for p in unreadable}
    found = copies(disks, warm)
    committed: dict[tuple[int, str], dict[str, Any]] = {}
    for copy in found:
        if copy.manifest is not None:
            committed.setdefault((copy.step, copy.save_id), copy.manifest)
    restorable: dict[int, str] = {}
    missing: dict[tuple[int, str], str] = {}
    for (step, save_id), manifest in sorted(committed.items()):
        same = [c for c in found if c.step == step and c.save_id == save_id]
        lacking = None
        for entry in manifest.get("files", []):
            path, size, crc = str(entry["path"]), int(entry["size"]), str(entry["checksum"])
            if not any(_intact(c.directory / path, size, crc, bad) for c in same):
                lacking = f"{path} (part {entry.get('node', 0)})"
                break
        if lacking is None:
            if step not in restorable or save_id > restorable[step]:
                restorable[step] = save_id
        else:
            missing[(step, save_id)] = lacking
    return Survey(found, committed, restorable, missing)


# --- quarantine ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quarantined:
    """A copy something moved into a quarantine directory."""

    where: str
    path: Path
    step: int
    reason: str
    save_id: str | None  # from its manifest or PART.json (None: neither readable)


def quarantined(disks: dict[str, Path], warm: Path | None) -> dict[Path, Quarantined]:
    """Every quarantined copy on the disks (their own and their peers/ directories) and warm."""
    roots: list[tuple[str, Path]] = []
    for host, disk in sorted(disks.items()):
        roots.append((host, disk / RUN / QUARANTINE))
        peers = disk / RUN / PEERS
        for part_dir in sorted(peers.iterdir()) if peers.is_dir() else []:
            roots.append((f"{host} {PEERS}/{part_dir.name}", part_dir / QUARANTINE))
    if warm is not None:
        roots.append(("warm", warm / RUN / QUARANTINE))
    found: dict[Path, Quarantined] = {}
    for where, root in roots:
        for child in sorted(root.iterdir()) if root.is_dir() else []:
            name = child.name.split(".", 1)[0]
            step = _step_of(name)
            if step is None:
                continue
            try:
                reason = (child / "QUARANTINE_REASON.txt").read_text().strip()
            except OSError:
                reason = "(no reason file)"
            body = _read_json(child / "manifest.json") or _read_json(child / "PART.json") or {}
            save_id = body.get("save_id") if isinstance(body.get("save_id"), str) else None
            found[child] = Quarantined(where, child, step, reason, save_id)
    return found


# --- the catalog ----------------------------------------------------------------------------------


def catalog_rows(url: str) -> list[Any]:
    catalog = Catalog.open(url)
    try:
        return list(catalog.checkpoints(RUN))
    finally:
        catalog.dispose()


def catalog_problems(url: str, final: Survey) -> list[str]:
    """Where the catalog (its final state, after the last launch) and the disks disagree:

    - a save committed on disk (its manifest in some copy) recorded ABANDONED (a failed save is
      recorded ABANDONED too);
    - a save whose every file survives recorded CORRUPT;
    - a save recorded COMMITTED/VERIFIED that no copy holds at all (no manifest, no part).
    A save the catalog never heard of (it was down) is no disagreement: the manifests are the truth."""
    problems = []
    held = {(c.step, c.save_id) for c in final.copies}
    for row in catalog_rows(url):
        key = (int(row.step), str(row.save_id))
        state = CheckpointState(row.state)
        if state == CheckpointState.ABANDONED and key in final.committed:
            problems.append(
                f"step {key[0]} save {key[1]}: committed on disk, recorded abandoned ({row.reason})"
            )
        if state == CheckpointState.CORRUPT and final.restorable.get(key[0]) == key[1]:
            problems.append(f"step {key[0]} save {key[1]}: whole on disk, recorded corrupt ({row.reason})")
        if state in (CheckpointState.COMMITTED, CheckpointState.VERIFIED) and key not in held:
            problems.append(f"step {key[0]} save {key[1]}: recorded {state.value}, held by no disk")
    return problems


def catalog_summary(url: str) -> str:
    try:
        rows = catalog_rows(url)
    except Exception as exc:  # noqa: BLE001 - a summary for a log
        return f"(catalog unreadable: {exc})"
    return "; ".join(f"{r.step}:{r.save_id}:{r.state}" for r in sorted(rows, key=lambda r: (r.step, r.id)))


def listing(disks: dict[str, Path], warm: Path | None) -> str:
    """Every file on the disks and warm (for a violation's log)."""
    lines = []
    roots = [*sorted(disks.items()), *([("warm", warm)] if warm is not None else [])]
    for name, root in roots:
        lines.append(f"== {name}: {root}")
        for dirpath, _dirs, files in sorted(os.walk(root)):
            for file in sorted(files):
                path = Path(dirpath) / file
                try:
                    size = path.stat().st_size
                except OSError:
                    size = -1
                lines.append(f"  {path.relative_to(root)} {size}")
    return "\n".join(lines)
