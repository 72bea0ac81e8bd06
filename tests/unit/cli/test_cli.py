"""The `ckptflow` command on real directories: ls, verify, cadence, catalog sync."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptflow.cli import app
from ckptflow.storage import checksums, layout
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest

runner = CliRunner()


def _invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def _commit(root: Path, step: int, files: dict[str, bytes], run: str = "cli") -> Path:
    """A committed checkpoint built by hand: real files, a real manifest with their checksums."""
    directory = root / layout.committed_name(step)
    directory.mkdir(parents=True)
    entries = []
    for name, data in files.items():
        (directory / name).write_bytes(data)
        entries.append(FileEntry(name, len(data), checksums.checksum_bytes(data)))
    manifest = Manifest(
        run=run,
        step=step,
        world_size=1,
        save_id=f"cafe0001-{step}",
        files=tuple(entries),
        created_at=f"2026-03-0{step % 9 + 1}T10:00:00Z",
    )
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    return directory


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Committed steps 100 and 200 (200: 3000 bytes in 2 files), a partial step 300, step 50 quarantined."""
    root = tmp_path / "ckpt"
    _commit(root, 100, {"__0_0.distcp": b"a" * 1000})
    _commit(root, 200, {"__0_0.distcp": b"b" * 2048, ".metadata": b"m" * 952})
    partial = root / layout.partial_name(300, "dead0001-300")
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"p" * 5000)
    (partial / "__1_0.distcp").write_bytes(b"q" * 120)
    layout.quarantine(root, _commit(root, 50, {"__0_0.distcp": b"c" * 10}), "__0_0.distcp: checksum (flip)")
    return root


def _row(output: str, step: int) -> list[str]:
    """The cells of the table row for ``step``: step, kind, files, size, created_at, reason."""
    rows = [line for line in output.splitlines() if re.match(rf"^[│|]\s+{step}\s+[│|]", line)]
    assert len(rows) == 1, output
    return [cell.strip() for cell in re.split(r"[│|]", rows[0])[1:-1]]


# --- ls -----------------------------------------------------------------------------------------


def test_ls_lists_every_kind(root):
    code, output = _invoke("ls", root)
    assert code == 0, output
    # Committed: files, size and date from the manifest (3000 bytes in 2 files).
    assert _row(output, 200) == ["200", "committed", "2", "2.9 KiB", "2026-03-03T10:00:00Z", ""]
    assert _row(output, 100) == ["100", "committed", "1", "1000 B", "2026-03-02T10:00:00Z", ""]
    # Partial: counted on disk (5000 + 120 bytes); its date is the directory's mtime.
    step, kind, files, size, created, reason = _row(output, 300)
    assert (step, kind, files, size, reason) == ("300", "partial", "2", "5.0 KiB", "")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", created)
    # Quarantined: the reason recorded next to it.
    quarantined = _row(output, 50)
    assert quarantined[1] == "quarantined"
    assert quarantined[5] == "__0_0.distcp: checksum (flip)"
    # Newest committed first, then partial, then quarantined.
    steps = [int(m) for m in re.findall(r"^[│|]\s+(\d+)\s+[│|]", output, flags=re.M)]
    assert steps == [200, 100, 300, 50]


def test_ls_incomplete_directory(root):
    (root / "step-400").mkdir()
    code, output = _invoke("ls", root)
    assert code == 0
    assert _row(output, 400)[1:4] == ["incomplete", "0", "0 B"]


def test_ls_committed_with_unreadable_manifest(root):
    (root / "step-200" / MANIFEST_NAME).write_text("{ torn")
    code, output = _invoke("ls", root)
    assert code == 0
    assert "manifest unreadable" in output


def test_ls_empty_root(tmp_path):
    code, output = _invoke("ls", tmp_path)
    assert code == 0
    assert "no checkpoints" in output


@pytest.mark.parametrize("make", ["missing", "file", "under_file"])
def test_ls_bad_root_is_one_line_exit_2(tmp_path, make):
    (tmp_path / "file").write_text("x")
    bad = {"missing": tmp_path / "nope", "file": tmp_path / "file", "under_file": tmp_path / "file" / "sub"}[
        make
    ]
    code, output = _invoke("ls", bad)
    assert code == 2
    assert str(bad) in output
    assert len(output.strip().splitlines()) == 1


# --- verify -------------------------------------------------------------------------------------


def test_verify_ok(root):
    code, output = _invoke("verify", root / "step-200", "--workers", "2")
    assert code == 0, output
    assert "OK" in output and "2 files" in output and "3000 bytes" in output


def test_verify_lists_every_bad_file(root):
    directory = root / "step-200"
    (directory / "__0_0.distcp").write_bytes(b"B" + b"b" * 2047)  # same size, other bytes
    (directory / ".metadata").unlink()
    code, output = _invoke("verify", directory)
    assert code == 1, output
    assert "__0_0.distcp: checksum" in output
    assert ".metadata: missing" in output


def test_verify_unsupported_version_exit_2(root):
    path = root / "step-100" / MANIFEST_NAME
    body = json.loads(path.read_text())
    body["format_version"] = 99
    path.write_text(json.dumps(body))
    code, output = _invoke("verify", root / "step-100")
    assert code == 2
    assert "format_version 99" in output and str(path) in output
    assert len(output.strip().splitlines()) == 1


def test_verify_directory_without_manifest_fails(root):
    code, output = _invoke("verify", root / "quarantine")
    assert code == 1
    assert "manifest" in output


def test_verify_missing_path_exit_2(tmp_path):
    code, output = _invoke("verify", tmp_path / "step-1")
    assert code == 2
    assert str(tmp_path / "step-1") in output


def test_verify_rejects_zero_workers(root):
    code, _ = _invoke("verify", root / "step-100", "--workers", "0")
    assert code == 2


# --- cadence ------------------------------------------------------------------------------------


def test_cadence_for_10k_gpus():
    code, output = _invoke("cadence", "--gpus", "10000", "--mtbf-years", "10", "--stall-s", "2")
    assert code == 0, output
    assert "system MTBF: 8.8 h" in output
    assert "Daly interval: 5.9 min" in output  # √(2 · 2 s · 8.77 h) ≈ 355 s
    assert "expected lost work per failure: 3.0 min" in output
    assert re.search(r"overhead: \d+\.\d% of wall time", output)


def test_cadence_restart_time_adds_to_lost_work():
    code, output = _invoke(
        "cadence", "--gpus", "10000", "--mtbf-years", "10", "--stall-s", "2", "--restart-s", "600"
    )
    assert code == 0
    assert "expected lost work per failure: 13.0 min" in output  # 3.0 min + 10 min


def test_cadence_write_time_floors_the_interval_and_adds_to_lost_work():
    code, output = _invoke(
        "cadence", "--gpus", "10000", "--mtbf-years", "10", "--stall-s", "2", "--write-s", "600"
    )
    assert code == 0, output
    assert "WRITE-BOUND, interval 10.0 min" in output  # Daly's 5.9 min cannot be kept
    assert "expected lost work per failure: 15.0 min" in output  # (600 + 2) / 2 s + 600 s


@pytest.mark.parametrize(
    "args",
    [
        ["--gpus", "0", "--mtbf-years", "10", "--stall-s", "2"],
        ["--gpus", "8", "--mtbf-years", "-1", "--stall-s", "2"],
        ["--gpus", "8", "--mtbf-years", "10", "--stall-s", "0"],
    ],
)
def test_cadence_bad_values_one_line_exit_2(args):
    code, output = _invoke("cadence", *args)
    assert code == 2
    assert len(output.strip().splitlines()) == 1
    assert "must be" in output


def test_cadence_requires_its_options():
    code, _ = _invoke("cadence", "--gpus", "8")
    assert code == 2


# --- catalog sync -------------------------------------------------------------------------------


def _sync(root: Path, url: str, *extra: str) -> dict[str, int]:
    code, output = _invoke("catalog", "sync", root, "--catalog", url, *extra)
    assert code == 0, output
    return {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", output.splitlines()[0])}


def test_catalog_sync_creates_rows_then_changes_nothing(root, tmp_path):
    catalog_mod = pytest.importorskip(
        "ckptflow.catalog", reason="ckptflow.catalog is not importable yet (being written)"
    )
    url = f"sqlite:///{tmp_path / 'catalog.db'}"

    first = _sync(root, url)
    assert first["created"] == 3  # steps 100, 200 (committed) and 50 (quarantined)
    assert first["marked_corrupt"] == 1
    assert first["unreadable"] == 0

    second = _sync(root, url)
    assert second == {"created": 0, "updated": 0, "marked_corrupt": 0, "marked_lost": 0, "unreadable": 0}

    catalog = catalog_mod.Catalog.open(url)
    try:
        states = {cp.step: cp.state for cp in catalog.checkpoints("cli")}
    finally:
        catalog.dispose()
    assert states[50] == catalog_mod.CheckpointState.CORRUPT
    assert states[100] != catalog_mod.CheckpointState.CORRUPT
    assert sorted(states) == [50, 100, 200]


def test_catalog_sync_only_one_run(root, tmp_path):
    pytest.importorskip("ckptflow.catalog", reason="ckptflow.catalog is not importable yet (being written)")
    _commit(root, 700, {"x.bin": b"x"}, run="other")
    counts = _sync(root, f"sqlite:///{tmp_path / 'c.db'}", "--run", "other")
    assert counts["created"] == 1


def test_catalog_sync_reports_unreadable_manifests(root, tmp_path):
    pytest.importorskip("ckptflow.catalog", reason="ckptflow.catalog is not importable yet (being written)")
    (root / "step-100" / MANIFEST_NAME).write_text("{ torn")
    code, output = _invoke("catalog", "sync", root, "--catalog", str(tmp_path / "c.db"))
    assert code == 0, output
    assert "unreadable 1" in output
    assert str(root / "step-100") in output


def test_catalog_sync_bad_catalog_url_exit_2(root, tmp_path):
    pytest.importorskip("ckptflow.catalog", reason="ckptflow.catalog is not importable yet (being written)")
    code, output = _invoke("catalog", "sync", root, "--catalog", str(tmp_path / "no" / "such" / "c.db"))
    assert code == 2
    assert len(output.strip().splitlines()) == 1


def test_catalog_sync_missing_root_exit_2(tmp_path):
    code, output = _invoke("catalog", "sync", tmp_path / "nope", "--catalog", str(tmp_path / "c.db"))
    assert code == 2
    assert str(tmp_path / "nope") in output
