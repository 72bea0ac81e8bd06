"""docs/RUNBOOK.md's "node drops at step N+1" section, walked on a real stack with the runbook's commands.

A training run (examples/train_tiny.py with ``--config``) commits steps 10..N and is SIGKILLed once it
has passed step N, like a node losing power; its hot root is deleted, as a replacement node has an
empty disk. Then every ```` ```bash runbook:node-drop ```` block of the runbook runs in order under
``bash`` with ``set -euo pipefail`` and the runbook's variables set (CONFIG, RUN, STEP, HOT), each must
exit 0, and each line of the ```` ```text runbook:node-drop expect ```` block after it must appear in
its output: variables substituted, runs of whitespace collapsed, ``...`` matching anything within a
line. A runbook edit that breaks a command or changes what it claims fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from replica_waits import replica_states, wait_ready

from ckptflow.services import stack as local_stack
from ckptflow.services.supervise import SupervisedProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
RUNBOOK = REPO / "docs" / "RUNBOOK.md"
EXAMPLE = REPO / "examples" / "train_tiny.py"
TAG = "runbook:node-drop"
RUN = "nodedrop"
N = 20  # the last committed step before the node drops; the runbook's $STEP
TOTAL_STEPS = 40  # the example job's --steps, as in the runbook's restart command
SAVE_EVERY = 10


@dataclass
class Block:
    """One ``bash runbook:node-drop`` block and the expectations that follow it."""

    line: int  # 1-based line of the opening fence in the runbook, for error messages
    script: str
    expect: list[str] = field(default_factory=list)


def extract_blocks(markdown: str, tag: str) -> list[Block]:
    """The ``bash <tag>`` blocks in order, each with the lines of the ``<lang> <tag> expect`` block after."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})(.*)$", lines[i])
        if opening is None:
            i += 1
            continue
        fence, words = opening.group(1), opening.group(2).split()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        assert end is not None, f"{RUNBOOK}:{i + 1}: code block never closed"
        body = lines[i + 1 : end]
        if tag in words[1:]:
            if "expect" in words[1:]:
                assert blocks, f"{RUNBOOK}:{i + 1}: an expect block before any {tag} command block"
                assert not blocks[-1].expect, f"{RUNBOOK}:{i + 1}: two expect blocks for one command"
                blocks[-1].expect = [line for line in body if line.strip()]
            else:
                assert words[0] == "bash", f"{RUNBOOK}:{i + 1}: a {tag} command block must be bash"
                blocks.append(Block(i + 1, "\n".join(body)))
        i = end + 1
    return blocks


def _substitute(text: str, variables: dict[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def expectation_met(expected: str, output: str, variables: dict[str, str]) -> bool:
    """Whether some line of ``output`` holds ``expected`` (``...`` = anything within the line)."""
    fragments = [f.strip() for f in _squash(_substitute(expected, variables)).split("...")]
    pattern = re.compile(".*".join(re.escape(f) for f in fragments if f))
    return any(pattern.search(_squash(line)) for line in output.splitlines())


def test_extract_blocks_pairs_commands_with_their_expectations():
    text = "\n".join(
        [
            "```bash",
            "not tagged",
            "```",
            f"```bash {TAG}",
            "echo one",
            "```",
            f"```text {TAG} expect",
            "one",
            "",
            "```",
            f"```bash {TAG}",
            "echo two",
            "```",
        ]
    )
    blocks = extract_blocks(text, TAG)
    assert [(b.script, b.expect) for b in blocks] == [("echo one", ["one"]), ("echo two", [])]
    assert expectation_met("│ $RUN │ ... │ none │", "│ r  │   20 │   20 │ none  │", {"RUN": "r"})
    assert not expectation_met("a ... b", "b a", {})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_stack.Stack]:
    directory = tmp_path_factory.mktemp("runbookstack")
    running = local_stack.up(directory, serve=True, reconcile_interval_s=3600)
    try:
        yield running
    finally:
        local_stack.down(directory)


def _node_drops_after_step(config: Path, run_dir: Path, log: Path) -> int:
    """Train, SIGKILL the process once step N is committed and it has passed step N; return its last step.

    A plain process (not torchrun) so that SIGKILL takes down everything that trained, as a node
    losing power does; the same script, config, run and hyperparameters as the runbook's restart.
    """
    argv = [sys.executable, str(EXAMPLE), "--config", str(config), "--run", RUN]
    argv += ["--steps", str(TOTAL_STEPS), "--save-every", str(SAVE_EVERY)]
    # Save phases on stdout, and steps slow enough that step N's save (its event post included, up to
    # emit_timeout_s) ends well before step N + SAVE_EVERY.
    argv += ["--trace-phases", "--step-sleep", "0.8"]
    proc = SupervisedProcess(argv, log_path=log)
    try:
        proc.wait_for(lambda line: line == f"STEP {N}", 180)
        # on_busy="wait": step N's save starts (staging) only after the previous one is done, so the
        # next "done" is step N's: committed, catalog rows written, its staged event posted.
        proc.wait_for(lambda line: line == "PHASE staging", 120)
        proc.wait_for(lambda line: line == "PHASE done", 120)
        line = proc.wait_for(lambda line: line.startswith("STEP "), 60)
    finally:
        proc.kill()
    assert line is not None, f"training ended early; see {log}"
    last = int(line.split()[1])
    assert N < last < N + SAVE_EVERY, f"killed at step {last}: no later save may have started"
    assert not any(p.name.startswith(f"step-{N + SAVE_EVERY}") for p in run_dir.iterdir())
    return last


def test_node_drop_runbook(stack, tmp_path):
    config = stack.config_path
    hot_root = Path(yaml.safe_load(config.read_text())["tiers"]["hot"]["root"])
    run_dir = hot_root / RUN
    _node_drops_after_step(config, run_dir, tmp_path / "train.log")
    steps = list(range(SAVE_EVERY, N + 1, SAVE_EVERY))
    wait_ready(config, RUN, steps)  # the event-driven promotions finished before the disk went
    shutil.rmtree(run_dir)  # the replacement node's disk is empty

    blocks = extract_blocks(RUNBOOK.read_text(), TAG)
    assert len(blocks) >= 5, f"expected the node-drop commands in {RUNBOOK}, found {len(blocks)} blocks"
    restart = [b for b in blocks if "examples/train_tiny.py" in b.script]
    assert len(restart) == 1 and "--config" in restart[0].script, "the restart must be the job's command"
    variables = {"CONFIG": str(config), "RUN": RUN, "STEP": str(N), "HOT": str(hot_root)}
    env = {
        **os.environ,
        **variables,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONIOENCODING": "utf-8",  # rich draws its tables with box characters on UTF-8
    }
    outputs: list[str] = []
    for block in blocks:
        proc = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + block.script],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
        )
        output = proc.stdout + proc.stderr
        outputs.append(output)
        where = f"{RUNBOOK.name}:{block.line}:\n{block.script}\n--- output ---\n{output[-4000:]}"
        assert proc.returncode == 0, f"exit {proc.returncode}: {where}"
        for expected in block.expect:
            assert expectation_met(expected, output, variables), f"expected {expected!r}: {where}"

    # Beyond what the runbook states: the restart resumed from step N on warm, finished, and its
    # new checkpoints joined the restored one; the catalog sync saw exactly the copies the disk took.
    restarted = outputs[blocks.index(restart[0])]
    assert f"START {N}" in restarted and f"STEP {TOTAL_STEPS}" in restarted and "DONE " in restarted
    assert "starting fresh" not in restarted and "quarantined" not in restarted
    assert any("catalog sync" in b.script for b in blocks)
    states = replica_states(config, RUN)  # the older steps' hot copies died with the disk
    assert [states[s]["hot"] for s in steps[:-1]] == ["lost"] * (len(steps) - 1), states
    on_hot = sorted(int(p.name.split("-")[1]) for p in run_dir.iterdir() if re.fullmatch(r"step-\d+", p.name))
    assert on_hot == list(range(N, TOTAL_STEPS + 1, SAVE_EVERY))
