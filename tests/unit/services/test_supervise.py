"""SupervisedProcess.kill: the whole process tree dies at once, as when a node loses power."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ckptflow.services.supervise import SupervisedProcess

# A parent that forks a child (as a DataLoader forks its workers); the child inherits stdout and
# would outlive a SIGKILL of its parent alone.
PARENT = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(f"CHILD {child}", flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return status != "Z"  # a zombie has died, only its exit status is left


def test_kill_takes_the_children_down_with_the_process(tmp_path: Path) -> None:
    proc = SupervisedProcess([sys.executable, "-c", PARENT], log_path=tmp_path / "log")
    line = proc.wait_for(lambda text: text.startswith("CHILD "), timeout_s=30)
    assert line is not None
    child = int(line.split()[1])
    t0 = time.monotonic()
    proc.kill()
    took = time.monotonic() - t0
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, 9)  # the test must not leave it behind
    assert not alive, "the child outlived its killed parent"
    assert took < 3.0, f"kill() took {took:.1f} s: it waited for the child to close stdout"
