"""A restore that writes files back onto a node's disk announces the checkpoint as staged again, so
that node's agent promotes and replicates what it now holds at once, not at its next housekeeping.
A real Prefect server (the session's), a real single-rank Checkpointer, a real warm tier the files
come back from."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import torch
from prefect.client.orchestration import get_client
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

from ckptflow.services.prefect_server import PrefectServer
from ckptflow.storage.events import STAGED_EVENT
from ckptflow.storage.manifest import read_manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.training_hooks import Checkpointer, ModelState

RUN = "announce-again"


def _staged_events(step: int, timeout_s: float = 30.0, wanted: int = 1) -> list:
    """The staged events of (RUN, step) the server has stored (it persists them in batches)."""
    flt = EventFilter(
        event=EventNameFilter(name=[STAGED_EVENT]),
        resource=EventResourceFilter(id=[f"ckptflow.checkpoint.{RUN}.{step}"]),
    )
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            events = client.read_events(filter=flt, limit=50).events
            if len(events) >= wanted or time.monotonic() > deadline:
                return events
            time.sleep(0.5)


def test_a_restore_that_fetched_files_onto_this_node_announces_the_checkpoint_again(
    tmp_path: Path, shared_prefect: PrefectServer
) -> None:
    hot, warm = tmp_path / "hot", PosixTier("warm", tmp_path / "warm")
    model = torch.nn.Linear(8, 8)
    state = {"app": ModelState(model)}

    def checkpointer() -> Checkpointer:
        return Checkpointer(
            RUN,
            hot,
            prefect_api_url=shared_prefect.api_url,
            prefect_auth_string=shared_prefect.auth_string,
            fallback_tiers=[warm],
        )

    first = checkpointer()
    assert first.save(5, state)
    first.close()
    step_dir = hot / RUN / "step-5"
    warm.put(step_dir, read_manifest(step_dir))
    (saved,) = _staged_events(5)  # the save's own announcement

    # A restart with nothing lost fetches nothing and announces nothing.
    again = checkpointer()
    assert again.restore(state) == 5 and again.stats.restore.fetched_hosts == []
    again.close()

    # The node lost a shard: the restore fetches it back from warm, then announces step 5 again,
    # an event of its own (Prefect drops a repeated id), naming where the files went.
    shard = next(p for p in step_dir.iterdir() if p.name.endswith(".distcp"))
    shard.unlink()
    restored = checkpointer()
    assert restored.restore(state) == 5
    assert restored.stats.restore.fetched_hosts == [socket.gethostname()]
    restored.close()  # the announcement is posted from the background thread; close waits for it
    assert shard.is_file()
    events = _staged_events(5, wanted=2)
    assert len(events) == 2, [e.payload for e in events]
    announced = next(e for e in events if e.id != saved.id)
    assert announced.payload["announced_again_after"] == f"restore onto {[socket.gethostname()]}"
    assert announced.payload["step"] == 5 and announced.payload["nodes"] == saved.payload["nodes"]
    assert [r.id for r in announced.related] == [r.id for r in saved.related]  # routed to the same agents
