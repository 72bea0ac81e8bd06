"""split_by_presence: which of a manifest's files a directory holds whole."""

from __future__ import annotations

from pathlib import Path

from ckptflow.storage.manifest import FileEntry
from ckptflow.storage.present import split_by_presence

CRC = "AAAAAAAAAAA="


def _entries(*sizes: int) -> list[FileEntry]:
    return [FileEntry(f"__{i}_0.distcp", size, CRC, rank=i) for i, size in enumerate(sizes)]


def test_files_at_their_size_are_present_and_the_rest_absent(tmp_path: Path) -> None:
    entries = _entries(10, 20, 30)
    (tmp_path / entries[0].path).write_bytes(b"x" * 10)  # whole
    (tmp_path / entries[1].path).write_bytes(b"x" * 5)  # still being written
    present, absent = split_by_presence(tmp_path, entries)
    assert present == [entries[0]] and absent == entries[1:]


def test_a_directory_that_does_not_exist_holds_nothing(tmp_path: Path) -> None:
    entries = _entries(1, 2)
    assert split_by_presence(tmp_path / "not-yet", entries) == ([], entries)
    assert split_by_presence(tmp_path / "not-yet", iter(entries)) == ([], entries)  # any iterable
