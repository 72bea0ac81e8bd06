"""User mistakes at restore and save: a clear error naming the culprit, and nothing on disk touched."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ckptflow.storage import checksums, layout
from ckptflow.storage.manifest import MANIFEST_NAME, UnsupportedManifestError
from ckptflow.training_hooks import Checkpointer, CheckpointLoadError, DataPosition, ModelState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

RUN = "badinput"


def _model(out_features: int = 4) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, out_features))


def _state(model: torch.nn.Module) -> dict:
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return {"app": ModelState(model, optimizer)}


def _listing(root: Path) -> list[tuple[str, int, int, str]]:
    """Every file and directory under ``root`` with size, mtime and content checksum."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.stat()
            crc = checksums.checksum_file(path)[0] if path.is_file() else ""
            out.append((str(path.relative_to(root)), st.st_size, st.st_mtime_ns, crc))
    return sorted(out)


@pytest.fixture
def hot(tmp_path: Path) -> Path:
    """A hot tier root with one committed checkpoint of the run at step 5 (in ``<hot>/<RUN>``)."""
    torch.manual_seed(0)
    hot = tmp_path / "hot"
    with Checkpointer(RUN, hot) as ckpt:
        assert ckpt.save(5, _state(_model()))
        ckpt.wait()
    assert layout.committed_steps(hot / RUN) == [5]
    return hot


def test_wrong_shape_names_the_key_and_moves_nothing(hot):
    before = _listing(hot / RUN)
    with Checkpointer(RUN, hot) as ckpt, pytest.raises(CheckpointLoadError) as info:
        ckpt.restore(_state(_model(out_features=5)))
    message = str(info.value)
    assert "'app.model.2.weight'" in message
    assert "(4, 16)" in message and "(5, 16)" in message
    assert _listing(hot / RUN) == before


def test_extra_key_names_the_key_and_moves_nothing(hot):
    before = _listing(hot / RUN)
    state = {**_state(_model()), "sampler": DataPosition()}
    with Checkpointer(RUN, hot) as ckpt, pytest.raises(CheckpointLoadError) as info:
        ckpt.restore(state)
    assert "sampler.epoch" in str(info.value) and "sampler.consumed" in str(info.value)
    assert _listing(hot / RUN) == before


def test_unsupported_manifest_version_names_the_manifest_and_moves_nothing(hot):
    manifest_path = hot / RUN / "step-5" / MANIFEST_NAME
    body = json.loads(manifest_path.read_text())
    body["format_version"] = 99
    manifest_path.write_text(json.dumps(body))
    before = _listing(hot / RUN)
    # A newer format is not corruption: restore must stop, not quarantine a good checkpoint.
    with Checkpointer(RUN, hot) as ckpt, pytest.raises(UnsupportedManifestError) as info:
        ckpt.restore(_state(_model()))
    assert str(manifest_path) in str(info.value)
    assert "99" in str(info.value)
    assert _listing(hot / RUN) == before
    assert not (hot / RUN / layout.QUARANTINE_DIR).exists()


def test_root_under_a_regular_file_is_refused_at_construction(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    bad = tmp_path / "file" / "sub"
    with pytest.raises(ValueError, match="Checkpointer.root") as info:
        Checkpointer(RUN, bad)
    assert str(bad) in str(info.value)
    assert (tmp_path / "file").read_text() == "not a directory"


def test_non_stateful_value_at_save_names_the_key(tmp_path):
    state = {**_state(_model()), "lr": 0.1}
    with Checkpointer(RUN, tmp_path / "hot") as ckpt:
        with pytest.raises(TypeError, match="state\\['lr'\\]"):
            ckpt.save(1, state)
        assert ckpt.stats.saves_started == 0
    assert layout.scan(tmp_path / "hot" / RUN) == []


def test_non_stateful_value_at_restore_names_the_key(hot):
    before = _listing(hot / RUN)
    state = {"app": torch.nn.Linear(8, 4).state_dict()}  # a plain dict, not a Stateful
    with Checkpointer(RUN, hot) as ckpt, pytest.raises(TypeError, match="state\\['app'\\]"):
        ckpt.restore(state)
    assert _listing(hot / RUN) == before


def test_saving_an_existing_step_is_a_no_op(hot):
    before = _listing(hot / RUN)
    step_dir = hot / RUN / "step-5"
    with Checkpointer(RUN, hot) as ckpt:
        state = _state(_model())
        assert ckpt.restore(state) == 5
        with torch.no_grad():
            for p in state["app"].model.parameters():
                p.add_(1.0)  # different values: an overwrite would change the bytes
        assert ckpt.save(5, state) is False
        assert ckpt.stats.skipped_existing == 1
        assert ckpt.stats.saves_started == 0
    assert _listing(hot / RUN) == before  # same names, sizes, mtimes and checksums
    assert sorted(p.name for p in (hot / RUN).iterdir()) == ["step-5"]  # no partial directory left behind
    assert (step_dir / MANIFEST_NAME).is_file()


def test_non_stateful_value_at_restore_on_a_fresh_root_names_the_key(tmp_path):
    with Checkpointer(RUN, tmp_path / "hot") as ckpt, pytest.raises(TypeError, match="state\\['lr'\\]"):
        ckpt.restore({**_state(_model()), "lr": 0.1})
