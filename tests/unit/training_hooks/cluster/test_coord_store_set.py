"""A value set through one client is there for every other client as soon as ``set`` returns.

A raw ``TCPStore.set`` only sends: on this machine a second client's ``check`` right after it missed
the key 151 times in 2,000 (the decision a straggler looks for before reporting).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from ckptflow.training_hooks.cluster.coord_store import CoordinationStore


def test_a_set_is_visible_to_another_client_when_it_returns() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20)
    )
    writer, reader = (
        CoordinationStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20)))
        for _ in range(2)
    )
    value = b"x" * 4096  # a decision's size: big enough that the server is still reading it
    missed = []
    for i in range(1000):
        writer.set(f"k{i}", value)
        if not reader.check([f"k{i}"]):
            missed.append(i)
    assert missed == []
    assert server.num_keys() >= 1000
