"""The rich progress adapter for tiers' ``Progress`` callbacks, and verification that reports bytes."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest
from rich.console import Console

from ckptflow.cli.progress import TransferBar, verify_with_bar
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.verify import verify_checkpoint

FILES = {"__0_0.distcp": 300_000, "__1_0.distcp": 200_000, ".metadata": 1_000, "sub/empty.bin": 0}


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, color_system=None, width=100), out


def _checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "step-5"
    entries = []
    for name, size in FILES.items():
        data = os.urandom(size)
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
        entries.append(FileEntry(name, size, checksums.checksum_bytes(data)))
    manifest = Manifest("r", 5, 1, "save5", tuple(entries))
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    return directory


def test_off_when_not_a_terminal_but_still_counting() -> None:
    out = io.StringIO()
    with TransferBar("fetch", 10, console=Console(file=out)) as bar:
        bar(4)
        bar(6)
    assert not bar.enabled and bar.bytes_done == 10
    assert out.getvalue() == ""


def test_worker_threads_are_counted_exactly() -> None:
    console, out = _terminal()
    threads, calls, chunk = 8, 2_000, 3
    total = threads * calls * chunk
    with TransferBar("warm step-7 [x]", total, console=console) as bar:

        def work() -> None:
            for _ in range(calls):
                bar(chunk)

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    assert bar.enabled and bar.bytes_done == total
    assert bar._progress.tasks[0].completed == total
    assert "warm step-7 [x]" in out.getvalue()  # the description is text, not rich markup
    assert "48.0/48.0 kB" in out.getvalue()


def test_a_failed_transfer_says_so() -> None:
    console, out = _terminal()
    with pytest.raises(OSError), TransferBar("cold step-7", 100, console=console) as bar:
        bar(50)
        raise OSError("endpoint gone")
    assert "cold step-7 failed" in out.getvalue()


def test_verification_reports_every_byte(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path)
    seen: list[int] = []
    lock = threading.Lock()

    def progress(n: int) -> None:
        with lock:
            seen.append(n)

    report = verify_checkpoint(directory, workers=3, progress=progress)
    assert report.ok and sum(seen) == sum(FILES.values()) == report.bytes_checked


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_verification_with_a_bar_reports_what_verify_reports(tmp_path: Path, damage: str) -> None:
    directory = _checkpoint(tmp_path)
    target = directory / "__1_0.distcp"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    else:
        target.unlink()
    plain = verify_checkpoint(directory)
    console, out = _terminal()
    with_bar = verify_with_bar(directory, console=console)
    assert not plain.ok
    assert (with_bar.problems, with_bar.bytes_checked) == (plain.problems, plain.bytes_checked)
    assert with_bar.summary() == plain.summary()
    assert "verify step-5" in out.getvalue()


def test_verify_with_bar_is_plain_verify_off_a_terminal(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path)
    report = verify_with_bar(directory, console=Console(file=io.StringIO()))
    assert report.summary() == verify_checkpoint(directory).summary()
    (directory / MANIFEST_NAME).write_text("{")
    console, _ = _terminal()
    assert verify_with_bar(directory, console=console).summary() == verify_checkpoint(directory).summary()
