"""``ckptflow import``: checkpoints written by stock torch.distributed.checkpoint, adopted and restored.

Sources: ``dcp.save`` and ``dcp.async_save`` in this process (one rank), and from a real 2-rank gloo
job (tests/integration/dcp_stock_worker.py: a replicated tensor, one tensor per rank, a row-sharded
DTensor, plain values) with ``dcp.save``, ``dcp.async_save`` and ``dcp.save(use_collectives=False)``.
Each is imported, then restored through ``Checkpointer.restore`` into fresh zeros and compared with
``torch.equal``: bit-exact. The restore reads every byte once, checked against the item CRCs the
import computed (``blocks``), never a whole-file second pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_stock_worker import Holder, own, replicated, sharded_full
from typer.testing import CliRunner

from ckptflow.catalog import Catalog, CheckpointState, ReplicaState
from ckptflow.cli import app
from ckptflow.storage import checksums, layout
from ckptflow.storage.layout import METADATA_NAME
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest
from ckptflow.storage.verify import verify_checkpoint
from ckptflow.training_hooks import Checkpointer
from ckptflow.training_hooks.adopt import ImportRefused, adopt_dcp_checkpoint
from ckptflow.training_hooks.restore.reader import load_metadata_safely

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

WORKER = Path(__file__).resolve().parents[1] / "dcp_stock_worker.py"
runner = CliRunner()


def _cli(*args: object) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def two_rank_saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints a 2-rank gloo job wrote with stock DCP (one launch)."""
    out = tmp_path_factory.mktemp("stock")
    init = out / f"init-{uuid.uuid4().hex}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = []
    for rank in range(2):
        cmd = [sys.executable, str(WORKER), "--rank", str(rank), "--world", "2"]
        cmd += ["--init-file", str(init), "--out", str(out)]
        log = (out / f"rank{rank}.log").open("wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    codes = [p.wait(timeout=300) for p in procs]
    logs = "\n".join((out / f"rank{r}.log").read_text(errors="replace") for r in range(2))
    assert codes == [0, 0], logs
    return out


def _single_rank_state() -> dict[str, Any]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    return {"model": model.state_dict(), "step": 1234, "schedule": {"lr": [0.1, 0.01], "warmup": 10}}


def _zeros_like(values: Any) -> Any:
    if isinstance(values, torch.Tensor):
        return torch.zeros_like(values)
    if isinstance(values, dict):
        return {k: _zeros_like(v) for k, v in values.items()}
    if isinstance(values, list):
        return [_zeros_like(v) for v in values]
    return type(values)() if isinstance(values, (int, float, str)) else None


def _assert_equal(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want)
        for key in want:
            _assert_equal(got[key], want[key])
    else:
        assert got == want


def _restore(hot: Path, run: str, template: dict[str, Any], url: str | None = None) -> tuple[int, Any, Any]:
    """(the step restored, its report, the values loaded) through Checkpointer.restore of ``run``
    under the hot tier root ``hot`` (the import wrote into ``hot/<run>``)."""
    holder = Holder(template)
    with Checkpointer(run, hot, catalog=url) as ckpt:
        step = ckpt.restore({"app": holder})
    return step, ckpt.stats.restore, holder.values


def _checked_blocks(directory: Path) -> None:
    """Every item span the (possibly merged) .metadata names has its own CRC in the manifest."""
    manifest = read_manifest(directory)
    metadata = load_metadata_safely((directory / METADATA_NAME).read_bytes())
    for index, info in metadata.storage_data.items():
        entry = manifest.entry(info.relative_path)
        assert entry is not None, index
        data = (directory / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert entry.block(info.offset, info.length) == checksums.checksum_bytes(data), index
    assert verify_checkpoint(directory).ok


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_single_rank_stock_checkpoint_imports_and_restores_bit_exactly(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _single_rank_state()
    source = tmp_path / "torchtitan" / "step-600"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "save":
            dcp.save({"app": Holder(saved)}, checkpoint_id=source)
        else:
            dcp.async_save({"app": Holder(saved)}, checkpoint_id=source).result()
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    root = tmp_path / "hot" / "titan"

    monkeypatch.chdir(tmp_path)  # a relative --root: the catalog still records where the checkpoint lies
    code, output = _cli(
        "import", source, "--run", "titan", "--root", root.relative_to(tmp_path), "--catalog", url
    )
    assert code == 0, output
    assert "imported=true run=titan step=600" in output and "cataloged=true" in output
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before  # the source is only read
    directory = root / layout.committed_name(600)
    _checked_blocks(directory)
    manifest = read_manifest(directory)
    assert manifest.format_version == 2 and [n.node for n in manifest.nodes] == [0]
    assert {f.node for f in manifest.files} == {0}

    step, report, values = _restore(tmp_path / "hot", "titan", _zeros_like(saved), url)
    assert step == 600
    _assert_equal(values, saved)
    data_bytes = sum(f.size for f in manifest.files if f.path != METADATA_NAME)
    assert 0 < report.bytes_read <= data_bytes  # each byte read once, by spans: no whole-file pass

    catalog = Catalog.open(url)
    try:
        (cp,) = catalog.checkpoints("titan")
        replicas = catalog.replicas(cp.id)
        events = catalog.undelivered_events()
    finally:
        catalog.dispose()
    assert cp.state == CheckpointState.VERIFIED and cp.step == 600
    assert cp.manifest_checksum == checksums.checksum_bytes((directory / MANIFEST_NAME).read_bytes())
    assert [(r.tier, r.state, r.uri) for r in replicas] == [("hot", ReplicaState.READY, str(directory))]
    assert [(e.run, e.step) for e in events] == [("titan", 600)]  # reconcile promotes it


def _two_rank_template() -> dict[str, Any]:
    words = {"rank": -1, "words": ["", ""]}
    return {
        "shared": torch.zeros(64, 16),
        "rank0": torch.zeros(32, dtype=torch.bfloat16),
        "rank1": torch.zeros(32, dtype=torch.bfloat16),
        "sharded": torch.zeros(sharded_full().shape),
        "note0": dict(words),
        "note1": dict(words),
    }


@pytest.mark.parametrize(("kind", "step"), [("save", 10), ("async", 20), ("nocoll", 30)])
def test_a_two_rank_stock_checkpoint_imports_and_restores_bit_exactly(
    two_rank_saves: Path, tmp_path: Path, kind: str, step: int
) -> None:
    source = two_rank_saves / kind / f"step-{step}"
    root = tmp_path / "hot" / kind
    report = adopt_dcp_checkpoint(source, kind, root)
    assert (report.step, report.world_size, report.merged_metadata) == (step, 2, kind == "nocoll")
    directory = root / layout.committed_name(step)
    _checked_blocks(directory)
    manifest = read_manifest(directory)
    assert {f.rank for f in manifest.files if f.path.endswith(".distcp")} == {0, 1}
    if kind == "nocoll":
        # Both ranks wrote the replicated tensor: one copy is .metadata's, the other an alternate.
        assert [a.fqn for a in manifest.alternates] == ["app.shared"]
    restored, _, values = _restore(tmp_path / "hot", kind, _two_rank_template())
    assert restored == step
    _assert_equal(
        values,
        {
            "shared": replicated(),
            "rank0": own(0),
            "rank1": own(1),
            "sharded": sharded_full(),
            "note0": {"rank": 0, "words": ["stock", "dcp"]},
            "note1": {"rank": 1, "words": ["stock", "dcp"]},
        },
    )


def test_import_into_the_configured_hot_tier(two_rank_saves: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = tmp_path / "ckptflow.yaml"
    config.write_text(f"catalog: {url}\ntiers:\n  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n")
    source = two_rank_saves / "save" / "step-10"
    code, output = _cli("import", source, "--run", "adopted", "--config", config, "--step", 77)
    assert code == 0, output
    assert (tmp_path / "hot" / "adopted" / "step-77" / MANIFEST_NAME).is_file()
    catalog = Catalog.open(url)
    try:
        assert [(cp.step, cp.state) for cp in catalog.checkpoints("adopted")] == [
            (77, CheckpointState.COMMITTED)
        ]
    finally:
        catalog.dispose()
    # The same step again is refused, naming it; nothing is published or changed.
    code, output = _cli("import", source, "--run", "adopted", "--config", config, "--step", 77)
    assert code == 2 and "already holds a committed checkpoint of step 77" in output
    assert not [e for e in layout.scan(tmp_path / "hot" / "adopted") if e.kind == "partial"]


def test_what_cannot_be_adopted_is_refused_with_the_reason(two_rank_saves: Path, tmp_path: Path) -> None:
    good = two_rank_saves / "save" / "step-10"
    root = tmp_path / "hot"

    interrupted = tmp_path / "interrupted" / "step-5"  # killed before DCP wrote its metadata
    interrupted.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp"):
        (interrupted / name).write_bytes((good / name).read_bytes())
    with pytest.raises(ImportRefused, match="no .metadata and no __<rank>.metadata"):
        adopt_dcp_checkpoint(interrupted, "r", root)

    truncated = tmp_path / "truncated" / "step-6"
    truncated.mkdir(parents=True)
    for path in good.iterdir():
        data = path.read_bytes()
        (truncated / path.name).write_bytes(data[: len(data) // 2] if path.name == "__1_0.distcp" else data)
    with pytest.raises(ImportRefused, match=r"__1_0\.distcp: span .* the file is truncated"):
        adopt_dcp_checkpoint(truncated, "r", root)

    unnamed = tmp_path / "latest"
    unnamed.symlink_to(good, target_is_directory=True)
    code, output = _cli("import", unnamed, "--run", "r", "--root", root)
    assert code == 2 and "pass the step (--step N)" in output

    code, output = _cli("import", good, "--run", "../x", "--root", root)
    assert code == 2 and "run name" in output

    in_place = root / "r" / "step-9"  # a DCP save straight into the hot root, under the final name
    in_place.parent.mkdir(parents=True)
    in_place.symlink_to(good, target_is_directory=True)
    with pytest.raises(ImportRefused, match="rename it"):
        adopt_dcp_checkpoint(in_place, "r", root / "r")
    assert in_place.is_symlink() and (good / METADATA_NAME).is_file()

    # A catalog that cannot be opened is found before anything is copied (the password never shown).
    unusable = f"sqlite:///{tmp_path / 'no-such-dir' / 'catalog.db'}"
    code, output = _cli("import", good, "--run", "r", "--root", root, "--catalog", unusable)
    assert code == 2 and "catalog" in output and len(output.strip().splitlines()) == 1
    assert not [e for e in layout.scan(root) if e.kind in ("partial", "committed")]
