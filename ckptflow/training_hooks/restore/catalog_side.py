"""Rank 0's catalog and event side of a restore: what restore records (a corrupt or superseded
step, the unfinished attempts it removed, the restored commit and its verification), the leases it
takes on the nodes' hot roots while they fetch, the peer addresses it reads, and the staged event it
announces again when it wrote parts onto a node's disk.

Only rank 0 holds the catalog and posts events; every call here is logged and never raised (the
catalog handle's contract): training restores whatever the catalog does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptflow.storage import layout
from ckptflow.storage.events import STAGED_EVENT, node_resources
from ckptflow.storage.manifest import MANIFEST_NAME, Manifest, parse_manifest
from ckptflow.training_hooks.commit.announce import EventPoster, build_event
from ckptflow.training_hooks.commit.catalog_handle import CatalogHandle
from ckptflow.training_hooks.commit.record import committed_record, save_time_hosts
from ckptflow.training_hooks.restore.context import RestoreReport

log = logging.getLogger("ckptflow.checkpointer")


@dataclass
class RestoreCatalogSide:
    """Rank 0's catalog (None: none configured) and event poster (None: no Prefect) for restores of
    ``run`` on ``host``, whose hot root is ``root``."""

    run: str
    run_dir: Path  # this node's directory of the run: <hot tier root>/<run>
    host: str
    catalog: CatalogHandle | None
    events: EventPoster | None
    fetch_timeout_s: float
    background: Executor  # the save thread: the re-announcement never blocks the restore

    def peer_endpoints(self, hosts: list[str]) -> dict[str, str]:
        assert self.catalog is not None
        return self.catalog.call("peer_endpoints", hosts) or {}

    def record_corrupt(self, step: int, reason: str, uri: str | None) -> None:
        if self.catalog is not None:
            self.catalog.call("record_corrupt", self.run, step, reason, uri)

    def audit(self, kind: str, detail: dict[str, Any]) -> None:
        if self.catalog is not None:
            self.catalog.call("audit", kind, self.run, None, **detail)

    def record_unfinished(self, step: int, save_id: str, reason: str) -> None:
        if self.catalog is not None:
            self.catalog.call("record_unfinished", self.run, step, save_id, reason)

    def lease_fetch(self, step: int, hosts: list[str]) -> Callable[[], None]:
        """Rank 0 takes the lease (run, step, hot, <host>) of every node about to fetch files into its
        hot root, on the nodes' behalf (only rank 0 holds the catalog), so the pipeline's writers of
        a node's hot root see the fetch. A lease another writer holds is waited for, a bounded time
        (a quarter of ``fetch_timeout_s``, at most two minutes: the other ranks wait for this fetch
        within ``fetch_timeout_s``), then taken over and logged: training never waits on the pipeline
        for longer. No heartbeat: the lease lasts the fetch's own deadline plus a minute. A catalog
        that fails is logged and the fetch goes on."""
        from ckptflow.catalog import RESTORE_FETCH, LeaseGrant  # noqa: PLC0415 - rank 0 with a catalog only

        assert self.catalog is not None
        holder = f"restore-fetch by rank 0 on {self.host} pid {os.getpid()}"
        deadline = time.monotonic() + min(self.fetch_timeout_s / 4, 120.0)
        tokens: list[str] = []
        waiting, told = list(hosts), set()
        while waiting:
            force = time.monotonic() >= deadline
            for host in list(waiting):
                got = self.catalog.call(
                    "acquire_lease",
                    self.run,
                    step,
                    "hot",
                    host,
                    holder=holder,
                    purpose=RESTORE_FETCH,
                    ttl_s=self.fetch_timeout_s + 60.0,
                    work_uri=str(self.run_dir / layout.committed_name(step)),
                    force=force,
                )
                if got is None or isinstance(got, LeaseGrant):
                    waiting.remove(host)  # granted, or no catalog to ask: fetch anyway
                if isinstance(got, LeaseGrant):
                    tokens.append(got.token)
                    if got.previous is not None:
                        log.warning("restore took over the lease on %s's hot copy: %s", host, got.previous)
                elif got is not None and host not in told:
                    told.add(host)
                    log.warning("restore waits (bounded) for the pipeline's writer: %s", got)
            if waiting:
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        catalog = self.catalog
        return lambda: None if not tokens else catalog.call("release_leases", tokens)

    def _restored_record(self, report: RestoreReport) -> tuple[Manifest, dict[str, Any]]:
        """The restored step's manifest and its commit record (as the save made them)."""
        assert report.manifest is not None and report.path is not None
        manifest = parse_manifest(report.manifest, where=str(report.path / MANIFEST_NAME))
        hosts = save_time_hosts(manifest, self.host)
        return manifest, committed_record(manifest, report.manifest, str(report.path), hosts)

    def record_restored_commit(self, report: RestoreReport) -> None:
        """The restored step is committed (its manifest just verified): the catalog records the
        commit, as the save would have, if the process that saved it died before it could (a
        no-op for a row already committed or verified)."""
        assert self.catalog is not None
        manifest, record = self._restored_record(report)
        self.catalog.call("record_committed", self.run, manifest.step, manifest.save_id, **record)

    def announce_again(self, report: RestoreReport, occasion: str) -> None:
        """Announce the restored checkpoint as staged once more, in the background: this restore
        wrote parts back onto the disks of ``report.fetched_hosts`` (a replacement node, a node
        that lost files), which their agents then promote and replicate at once rather than at
        their next housekeeping (the first announcement fired before those disks held anything).
        An event of its own (its id names this restore: Prefect drops a repeated id); nodes whose
        part is already on warm find nothing to do. Not delivered, it is only logged: each node's
        housekeeping still promotes what it holds."""
        assert self.events is not None
        manifest, record = self._restored_record(report)
        payload = {**record["event_payload"], "announced_again_after": f"restore onto {report.fetched_hosts}"}
        event = build_event(
            STAGED_EVENT,
            self.run,
            manifest.step,
            manifest.save_id,
            payload,
            related=node_resources(payload["nodes"]),
            occasion=occasion,
        )
        events = self.events
        self.background.submit(events.post, [event])
        log.info(
            "announced step %d as staged again: this restore wrote parts onto %s",
            manifest.step,
            ", ".join(report.fetched_hosts),
        )
