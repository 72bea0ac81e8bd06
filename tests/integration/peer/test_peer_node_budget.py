"""One bandwidth cap per node across processes: two pushes, or a push and a promote copy to warm,
run at once in separate processes (as the agent runs flow runs) under a 4 MiB/s cap and send at
most 4.4 MiB/s together. A real server on 127.0.0.1, real files, real processes.

The rate asserted is an upper bound (a slow machine only lowers it); that the two senders really
overlapped is asserted too, else the bound would prove nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from peer_parts import SECRET, make_checkpoint

from ckptflow.peer import PeerServer

pytestmark = pytest.mark.slow

MIB = 1 << 20
CAP = 4 * MIB

# One sender, in a process of its own: waits for the go file, sends, prints its interval and bytes.
SENDER = """
import json, sys, time
from pathlib import Path
from ckptflow.peer.client import push_part
from ckptflow.peer.node_budget import NodeBandwidth
from ckptflow.storage.manifest import read_manifest
from ckptflow.storage.posix_tier import PosixTier

kind, step_dir, hot, part, url, warm, go, cap = sys.argv[1:9]
step_dir = Path(step_dir)
manifest = read_manifest(step_dir)
budget = NodeBandwidth(hot, float(cap))
while not Path(go).exists():
    time.sleep(0.005)
start = time.monotonic()
if kind == "push":
    sent = push_part(step_dir, manifest, int(part), url, sys.argv[9], bucket=budget).bytes_sent
else:
    paths = [e.path for e in manifest.files if e.node == int(part)]
    sent = PosixTier("warm", warm).paced(budget.take).put_files(step_dir, manifest, paths).bytes
print(json.dumps({"start": start, "end": time.monotonic(), "bytes": sent}))
"""


@pytest.mark.parametrize("second", ["push", "copy"])
def test_two_senders_of_a_node_in_two_processes_share_its_cap(tmp_path: Path, second: str) -> None:
    ckpt = make_checkpoint(nodes=2, files_per_node=2, size=3 * MIB)  # 6 MiB a part
    hot = tmp_path / "owner-hot"
    step_dir = ckpt.write_node(hot, 0)
    ckpt.write_node(hot, 1)  # the node holds both parts (one pushed, one pushed or copied to warm)
    (tmp_path / "peer-hot").mkdir()
    (tmp_path / "warm").mkdir()
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with PeerServer(tmp_path / "peer-hot", SECRET) as server:
        senders = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    SENDER,
                    kind,
                    str(step_dir),
                    str(hot),
                    str(part),
                    server.url,
                    str(tmp_path / "warm"),
                    str(go),
                    str(CAP),
                    SECRET,
                ],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for kind, part in (("push", 0), (second, 1))
        ]
        go.touch()  # both processes are up (imports done) before either starts its clock
        outputs = []
        for sender in senders:
            out, _ = sender.communicate(timeout=120)
            assert sender.returncode == 0
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["bytes"] >= 6 * MIB for o in outputs)  # each sent its whole part
    first, other = outputs
    assert first["start"] < other["end"] and other["start"] < first["end"]  # they overlapped
    elapsed = max(o["end"] for o in outputs) - min(o["start"] for o in outputs)
    rate = sum(o["bytes"] for o in outputs) / elapsed
    assert rate <= 1.1 * CAP, f"{rate / MIB:.2f} MiB/s together under a {CAP / MIB:.0f} MiB/s cap"
