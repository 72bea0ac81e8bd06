"""Run names are path components: one rule (ckptflow.storage.run_names), checked by the Checkpointer,
manifest parsing, the promote flow, the CLI and every tier; deletes refuse paths that resolve outside
the tier root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, ManifestError, parse_manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.run_names import MAX_RUN_NAME, check_run_name
from ckptflow.storage.s3_tier import S3Tier

BAD = ["", ".", "..", "../../x", "a/b", "/abs", "-flag", ".hidden", "a b", "x\x00", "é"]
BAD.append("a" * (MAX_RUN_NAME + 1))
GOOD = ["demo", "demo-20250101-120000", "llama_3.1", "A9", "run.", "a..b", "a" * MAX_RUN_NAME]


@pytest.mark.parametrize("name", GOOD)
def test_ordinary_names_pass(name: str) -> None:
    assert check_run_name(name) == name


@pytest.mark.parametrize("name", [*BAD, None, 7])
def test_bad_names_raise_naming_the_field_the_rule_and_a_fix(name: object) -> None:
    with pytest.raises(ValueError) as info:
        check_run_name(name, "job.run")
    message = str(info.value)
    assert message.startswith("job.run: ") and "one path component" in message
    assert "rename the run" in message or "choose a name" in message or "pass a string" in message


def test_the_suggested_name_passes() -> None:
    with pytest.raises(ValueError, match="e.g. 'my-run-1'"):
        check_run_name("../my run/1")
    check_run_name("my-run-1")


def test_the_checkpointer_refuses_dot_dot(tmp_path: Path) -> None:
    from ckptflow.training_hooks import Checkpointer

    for name in ("..", "."):
        with pytest.raises(ValueError, match=r"Checkpointer\.run: '\.+' is not a valid run name"):
            Checkpointer(name, tmp_path / "root")
    assert not (tmp_path / "root").exists()


def _manifest_bytes(run: str) -> bytes:
    body = {
        "format": "ckptflow.manifest",
        "format_version": 1,
        "run": run,
        "step": 1,
        "world_size": 1,
        "save_id": "s1",
        "checksum_algorithm": checksums.ALGORITHM,
        "files": [{"path": "a.bin", "size": 3, "checksum": checksums.checksum_bytes(b"abc"), "rank": 0}],
    }
    return json.dumps(body).encode()


def test_a_manifest_whose_run_climbs_out_is_not_a_manifest() -> None:
    assert parse_manifest(_manifest_bytes("fine"), where="m.json").run == "fine"
    with pytest.raises(ManifestError, match=r"m\.json: field 'run': '\.\./\.\./x' is not a valid run name"):
        parse_manifest(_manifest_bytes("../../x"), where="m.json")


def _committed(directory: Path, run: str = "victim") -> Path:
    """A real committed checkpoint (one file and its manifest) at ``directory``."""
    directory.mkdir(parents=True)
    (directory / "a.bin").write_bytes(b"abc")
    (directory / MANIFEST_NAME).write_bytes(_manifest_bytes(run))
    return directory


def test_every_posix_tier_method_refuses_a_run_that_climbs_out(tmp_path: Path) -> None:
    # root/../step-1 is a committed checkpoint of someone else: '..' as a run name would reach it.
    victim = _committed(tmp_path / "step-1")
    tier = PosixTier("hot", tmp_path / "root")
    (tmp_path / "root").mkdir()
    manifest = Manifest("..", 1, 1, "s1", (FileEntry("a.bin", 3, checksums.checksum_bytes(b"abc")),))
    calls = {
        "path": lambda: tier.path("..", 1),
        "uri": lambda: tier.uri("..", 1),
        "list_steps": lambda: tier.list_steps(".."),
        "read_manifest": lambda: tier.read_manifest("..", 1),
        "verify": lambda: tier.verify("..", 1),
        "fetch": lambda: tier.fetch("..", 1, tmp_path / "fetched"),
        "put": lambda: tier.put(victim, manifest),
        "delete": lambda: tier.delete("..", 1),
        "soft_delete": lambda: tier.soft_delete("..", 1),
        "soft_deleted": lambda: tier.soft_deleted("..", 1),
        "purge": lambda: tier.purge("..", 1),
        "restore_soft_deleted": lambda: tier.restore_soft_deleted("..", 1),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="hot tier: run: '..' is not a valid run name"):
            call()
        assert (victim / MANIFEST_NAME).read_bytes() == _manifest_bytes("victim"), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root", "step-1"]


def test_deletes_refuse_a_step_or_run_that_is_a_symlink_out_of_the_root(tmp_path: Path) -> None:
    outside = _committed(tmp_path / "elsewhere" / "step-1")
    root = tmp_path / "root"
    (root / "linked-step").mkdir(parents=True)
    (root / "linked-step" / "step-1").symlink_to(outside, target_is_directory=True)
    (root / "linked-run").symlink_to(outside.parent, target_is_directory=True)
    tier = PosixTier("warm", root)
    for run in ("linked-step", "linked-run"):
        with pytest.raises(RuntimeError, match="refusing to delete .* outside the tier root"):
            tier.delete(run, 1)
        with pytest.raises(RuntimeError, match="refusing to soft-delete .* outside the tier root"):
            tier.soft_delete(run, 1)
        assert (outside / MANIFEST_NAME).is_file() and (outside / "a.bin").read_bytes() == b"abc"
    # A trash directory reached through a symlinked run directory is not purged either.
    trash = _committed(tmp_path / "elsewhere" / "step-2.trash-20250101T000000000000Z-abcdef")
    with pytest.raises(RuntimeError, match="refusing to purge .* outside the tier root"):
        tier.purge("linked-run", 2)
    assert (trash / "a.bin").is_file()
    assert tier.cleanup_stale(0) == [] and (outside / "a.bin").is_file()


def test_a_real_run_inside_the_root_is_still_deleted(tmp_path: Path) -> None:
    tier = PosixTier("hot", tmp_path / "root")
    _committed(tmp_path / "root" / "victim" / "step-1")
    assert tier.list_steps("victim") == [1]
    trash = tier.soft_delete("victim", 1)
    assert tier.purge("victim", trash) == [trash]
    _committed(tmp_path / "root" / "victim" / "step-2")
    tier.delete("victim", 2)
    assert list((tmp_path / "root" / "victim").iterdir()) == []


def test_every_s3_tier_method_refuses_a_bad_run_before_any_request(tmp_path: Path) -> None:
    # Nothing listens on port 1: a request would fail with a TierError, not the ValueError expected.
    tier = S3Tier("cold", "bucket", prefix="runs", endpoint_url="http://127.0.0.1:1", max_attempts=1)
    manifest = Manifest("../x", 1, 1, "s1", ())
    calls = {
        "uri": lambda: tier.uri("..", 1),
        "list_steps": lambda: tier.list_steps(".."),
        "read_manifest": lambda: tier.read_manifest("../x", 1),
        "verify": lambda: tier.verify("..", 1),
        "fetch": lambda: tier.fetch("..", 1, tmp_path / "fetched"),
        "put_files": lambda: tier.put_files(tmp_path, manifest),
        "delete": lambda: tier.delete("..", 1),
        "soft_delete": lambda: tier.soft_delete("..", 1),
        "soft_deleted": lambda: tier.soft_deleted("..", 1),
        "purge": lambda: tier.purge("..", 1),
        "restore_soft_deleted": lambda: tier.restore_soft_deleted("..", 1),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"cold tier: run: '\.\.(/x)?' is not a valid run name"):
            call()
        assert not (tmp_path / "fetched").exists(), name


def test_an_s3_prefix_with_dot_segments_is_refused() -> None:
    for prefix in ("..", "runs/../other", "./runs"):
        with pytest.raises(ValueError, match="prefix: .* '.' or '..' segment"):
            S3Tier("cold", "bucket", prefix=prefix)
    assert S3Tier("cold", "bucket", prefix="/runs/v1/").prefix == "runs/v1"


def test_the_promote_flow_refuses_an_event_payload_that_climbs_out(tmp_path: Path) -> None:
    from ckptflow.flows.promote import promote

    with pytest.raises(ValueError, match=r"promote: parameter 'run': '\.\./\.\./x' is not a valid run name"):
        promote.fn("../../x", 1, str(tmp_path / "ckptflow.yaml"))


def test_node_housekeeping_leaves_directories_that_are_not_runs_alone(tmp_path: Path) -> None:
    from ckptflow.flows.node_housekeeping import runs_on_hot as _runs_on_hot

    for name in ("lost+found", ".Trash-1000", "run-a", "run_b"):
        (tmp_path / name).mkdir()
    runs, skipped = _runs_on_hot(str(tmp_path))
    assert runs == ["run-a", "run_b"]
    assert len(skipped) == 2 and all("is not a valid run name" in s for s in skipped)


@pytest.mark.parametrize(
    "argv",
    [
        ["restore", "--run", "..", "--config", "ckptflow.yaml", "--to", "out"],
        ["promote", "../x", "1", "--config", "ckptflow.yaml"],
        ["status", "--run", "a/b", "--config", "ckptflow.yaml"],
        ["catalog", "sync", ".", "--catalog", "sqlite:///c.db", "--run", ".."],
        ["drill", "history", "--catalog", "sqlite:///c.db", "--run", ".."],
    ],
)
def test_every_cli_entry_taking_a_run_refuses_a_bad_one(argv: list[str], tmp_path: Path, monkeypatch) -> None:
    from ckptflow.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert "is not a valid run name" in result.output, result.output
    assert list(tmp_path.iterdir()) == []  # nothing was created (no catalog file, no directory)
