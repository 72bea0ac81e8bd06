"""The drill spec: valid specs load with paths made absolute; bad ones get one error naming the field."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from ckptflow.policy.drill_spec import load_drill_spec
from ckptflow.policy.yaml_source import ConfigError

GOOD = """\
name: tiny-nightly
run: tiny
checkpoint: latest
world_size: 2
eval: train_tiny:drill_eval
eval_kwargs: {hidden: 64, seed: 0}
python_path: [../examples]
tolerance: 1.0e-6
rto: 10m
config: ckptflow.yaml
"""


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "specs" / "drill.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(body)
    return path


def test_a_valid_spec_loads_with_defaults_and_absolute_paths(tmp_path):
    spec = load_drill_spec(_write(tmp_path, GOOD))
    assert spec.tier == "cold" and spec.metric == "eval_loss" and spec.world_size == 2
    assert spec.rto == timedelta(minutes=10) and spec.job_timeout_s == 1800.0 and spec.rto_s == 600.0
    assert spec.python_path == [str((tmp_path / "examples").resolve())]
    assert spec.config == str((tmp_path / "specs" / "ckptflow.yaml").resolve())
    assert spec.eval_kwargs == {"hidden": 64, "seed": 0}


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (("run: tiny", "run: tiny\ncolour: blue"), "colour", "unknown key"),
        (("eval: train_tiny:drill_eval", "eval: train_tiny.drill_eval"), "eval", "module:function"),
        (("eval: train_tiny:drill_eval", "eval: 'train tiny:x'"), "eval", "module:function"),
        (("rto: 10m", "rto: 600"), "rto", "duration"),
        (("rto: 10m", "rto: 0s"), "rto", "longer than zero"),
        (("rto: 10m", "rto: 10m\njob_timeout: 5m"), "job_timeout", "shorter than rto"),
        (("checkpoint: latest", "checkpoint: newest"), "checkpoint", "latest, random or a step"),
        (("checkpoint: latest", "checkpoint: -5"), "checkpoint", "0 or more"),
        (("checkpoint: latest", "checkpoint: yes"), "checkpoint", ""),
        (("world_size: 2", "world_size: 0"), "world_size", ""),
        (("world_size: 2", "world_size: '2'"), "world_size", ""),
        (("tolerance: 1.0e-6", "tolerance: 1e-6"), "tolerance", ""),  # YAML 1.1 reads 1e-6 as text
        (("tolerance: 1.0e-6", "tolerance: -1.0"), "tolerance", ""),
        (("name: tiny-nightly", "name: 'tiny nightly!'"), "name", "letters, digits"),
        (("run: tiny\n", ""), "run", "required field is missing"),
    ],
)
def test_bad_specs_name_file_line_and_field(tmp_path, change, field, words):
    old, new = change
    path = _write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(ConfigError) as info:
        load_drill_spec(path)
    message = str(info.value)
    assert message.startswith(str(path)) and f"'{field}'" in message and words in message, message


def test_a_given_step_and_random_choice_with_seed(tmp_path):
    spec = load_drill_spec(_write(tmp_path, GOOD.replace("checkpoint: latest", "checkpoint: 200")))
    assert spec.checkpoint == 200
    spec = load_drill_spec(
        _write(tmp_path, GOOD.replace("checkpoint: latest", "checkpoint: random\nseed: 7"))
    )
    assert spec.checkpoint == "random" and spec.seed == 7
