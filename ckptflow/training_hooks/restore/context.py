"""What a restore needs (:class:`RestoreContext`), what it reports (:class:`RestoreReport`), and the
one error a restore raises for the caller's own mistake (:class:`CheckpointLoadError`): the types the
stages of a restore share, so that none of them imports another for a type."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptflow.storage.tier import Tier
from ckptflow.training_hooks.cluster.coord_store import CoordinationStore
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.restore.reader import ReadHook
from ckptflow.training_hooks.restore.sources import PeerAccess
from ckptflow.training_hooks.save.staging import HostStager


class CheckpointLoadError(ValueError):
    """The checkpoint verified, but the state passed to restore does not match what it holds."""


@dataclass
class RestoreReport:
    """What restore chose and why, and what it cost (this rank's view)."""

    step: int = 0
    path: Path | None = None
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (step, why it was not used)
    removed_partials: list[str] = field(default_factory=list)
    removed_quarantine: list[dict[str, Any]] = field(default_factory=list)  # path, bytes, why (this node)
    source: str = "hot"  # "hot", or where this rank fetched the files its node lacked ("peer <host>", a tier)
    node: int = 0
    nodes: int = 1
    fetched_files: int = 0  # files this rank downloaded from colder tiers into its node's hot root
    fetched_bytes: int = 0
    fetched_by_source: dict[str, int] = field(default_factory=dict)  # "peer <host>" / tier -> bytes
    fetched_hosts: list[str] = field(default_factory=list)  # every node that fetched files (all ranks)
    fetch_s: float = 0.0
    load_s: float = 0.0  # reading, verifying and deserializing (one pass)
    verify_s: float = 0.0  # of load_s: computing and comparing checksums
    bytes_read: int = 0  # bytes this rank read (and verified) to load
    reserved_bytes: int = 0  # staging buffers allocated (the load's shadow, then the saves' buffers)
    manifest: bytes | None = field(default=None, repr=False)  # the restored step's, as verified

    @property
    def bytes_verified(self) -> int:
        return self.bytes_read

    def describe(self) -> str:
        if self.path is None:
            text = "no committed checkpoint that verifies: starting fresh at step 0"
        else:
            fetched = (
                f"fetched {self.fetched_files} file(s), {self.fetched_bytes / 1e6:.1f} MB "
                f"in {self.fetch_s:.2f} s; "
                if self.fetched_files
                else ""
            )
            text = (
                f"restored step {self.step} from {self.path} (source tier: {self.source}; node "
                f"{self.node} of {self.nodes}; {fetched}read and verified {self.bytes_read / 1e6:.1f} MB "
                f"in {self.load_s:.2f} s on this rank)"
            )
        for step, reason in self.rejected:
            text += f"; step {step} not used: {reason}"
        if self.reserved_bytes:
            text += f"; staging buffers reserved: {self.reserved_bytes / 1e6:.1f} MB"
        return text


@dataclass
class RestoreContext:
    """What a restore needs besides the state."""

    run: str
    run_dir: Path  # this node's directory of the run: <hot tier root>/<run>
    topology: Topology
    store: CoordinationStore
    attempt_id: str  # unique to this restore call, equal on every rank (names store keys)
    fallbacks: list[Tier]
    stager: HostStager
    workers: int
    fetch_timeout_s: float
    stale_partial_age_s: float
    quarantine_keep_s: float
    on_phase: Callable[[str], None]
    record_corrupt: Callable[[int, str, str | None], None] | None = None  # rank 0: the catalog
    # rank 0: (step, save id, reason) of each save attempt whose unfinished files were removed
    record_unfinished: Callable[[int, str, str], None] | None = None
    read_hook: ReadHook | None = None
    peers: PeerAccess | None = None  # the replication secret (endpoints filled in at restore)
    peer_endpoints: Callable[[list[str]], dict[str, str]] | None = None  # rank 0: host -> url
    # rank 0: record an event in the catalog's log (kind, detail): what restore removed, for audit
    audit: Callable[[str, dict[str, Any]], None] | None = None
    # rank 0: take the leases (run, step, hot, host) of the nodes about to fetch; returns the release
    lease_fetch: Callable[[int, list[str]], Callable[[], None]] | None = None
