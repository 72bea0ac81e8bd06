"""Scale-out: with ``prefect.task_runner: dask`` the promote and scrub flows fan their batch tasks out
to a Dask cluster (prefect-dask), here a real two-worker ``LocalCluster`` on loopback, with a real
Prefect server; the default stays a thread pool.

The proof that the tasks ran on the cluster cannot be faked by threads of this process: the Dask
scheduler's task stream names the worker that ran each task, and every worker is a process of its own.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.pipeline.tiers import DEFAULT_MAX_BATCHES, load
from ckptflow.policy.config import CkptflowConfig, load_config
from ckptflow.policy.yaml_source import ConfigError
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, manifest_checksum
from ckptflow.storage.posix_tier import PosixTier

MiB = 1 << 20
RUN = "dask-run"
STEP = 40
FILES = {  # six files -> DEFAULT_MAX_BATCHES (4) batch tasks per hop
    "__0_0.distcp": 6 * MiB,
    "__1_0.distcp": 5 * MiB,
    "__2_0.distcp": 3 * MiB,
    "__3_0.distcp": 2 * MiB,
    ".metadata": 40_000,
    "extra/empty.bin": 0,
}
DAMAGED = "__2_0.distcp"


def _config_text(tmp_path: Path, catalog: str, prefect: dict[str, Any]) -> str:
    body = {
        "catalog": catalog,
        "prefect": prefect,
        "tiers": {
            "hot": {"kind": "posix", "root": str(tmp_path / "hot")},
            "warm": {"kind": "posix", "root": str(tmp_path / "warm"), "price_per_gb_month": 0.03},
        },
    }
    return yaml.safe_dump(body, sort_keys=False)


# ------------------------------------------------------------------------ config and runner choice
def test_the_default_task_runner_is_a_thread_pool(tmp_path: Path) -> None:
    from prefect.task_runners import ThreadPoolTaskRunner

    from ckptflow.flows.runners import task_runner_for

    path = tmp_path / "ckptflow.yaml"
    path.write_text(_config_text(tmp_path, "sqlite:///c.db", {"emit_timeout_s": 5}))
    runner = task_runner_for(load_config(path), threads=8)
    assert isinstance(runner, ThreadPoolTaskRunner) and runner == ThreadPoolTaskRunner(max_workers=8)
    from ckptflow.flows.runners import batch_count

    assert batch_count(load_config(path)) == 1  # threads: the tier's own pool moves the files


def test_dask_runner_connects_to_the_configured_address_or_starts_a_local_cluster(tmp_path: Path) -> None:
    from prefect_dask import DaskTaskRunner

    from ckptflow.flows.runners import local_cluster_kwargs, task_runner_for

    def config(prefect: dict[str, Any]) -> CkptflowConfig:
        path = tmp_path / "ckptflow.yaml"
        path.write_text(_config_text(tmp_path, "sqlite:///c.db", prefect))
        return load_config(path)

    remote = task_runner_for(config({"task_runner": "dask", "dask_address": "tcp://127.0.0.1:8786"}), 8)
    assert isinstance(remote, DaskTaskRunner) and remote.address == "tcp://127.0.0.1:8786"
    assert remote.cluster_kwargs == {}  # an existing cluster: nothing started, nothing stopped
    local = task_runner_for(config({"task_runner": "dask"}), 8)
    assert isinstance(local, DaskTaskRunner) and local.address is None
    assert local.cluster_kwargs == local_cluster_kwargs()
    kwargs = local_cluster_kwargs()
    assert kwargs["host"] == "127.0.0.1" and kwargs["dashboard_address"] is None  # loopback only
    assert 1 <= kwargs["n_workers"] <= DEFAULT_MAX_BATCHES and kwargs["processes"] is True
    from ckptflow.flows.runners import batch_count

    assert batch_count(config({"task_runner": "dask"})) == DEFAULT_MAX_BATCHES  # spread over workers
    with pytest.raises(ValueError, match="threads must be >= 1"):
        task_runner_for(config({}), 0)


def test_a_dask_address_without_the_dask_runner_names_the_field_and_line(tmp_path: Path) -> None:
    path = tmp_path / "ckptflow.yaml"
    for prefect in (
        {"dask_address": "tcp://127.0.0.1:8786"},
        {"task_runner": "threads", "dask_address": "x:1"},
    ):
        text = _config_text(tmp_path, "sqlite:///c.db", prefect)
        path.write_text(text)
        with pytest.raises(ConfigError) as failure:
            load_config(path)
        message = str(failure.value)
        line = next(n for n, row in enumerate(text.splitlines(), 1) if "dask_address" in row)
        assert message.startswith(f"{path}:{line}: field 'prefect.dask_address'"), message
        assert "task_runner: dask" in message, message  # says the fix
    path.write_text(_config_text(tmp_path, "sqlite:///c.db", {"task_runner": "dask", "dask_address": ""}))
    with pytest.raises(ConfigError, match="'prefect.dask_address'"):
        load_config(path)


# ------------------------------------------------------------------------------ the real cluster
@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prefect server on 127.0.0.1 (never an ephemeral one), this process's client on it."""
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED

    from ckptflow.services.prefect_server import PrefectServer

    server = PrefectServer.start(tmp_path_factory.mktemp("prefect"))
    try:
        with server.reporting({PREFECT_LOGGING_TO_API_ENABLED: False}):
            yield server.api_url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def dask_cluster(prefect_api: str) -> Iterator[Any]:
    """Two single-threaded worker processes and their scheduler, all on loopback, no dashboard."""
    import distributed

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFECT_LOGGING_TO_API_ENABLED", "false")  # inherited by the spawned workers
        cluster = distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
        )
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def observer(dask_cluster: Any) -> Iterator[Any]:
    """A client of our own for looking at the cluster; not the default client, so the flows'
    DaskTaskRunner must connect through ``dask_address`` like any other process would."""
    import distributed

    client = distributed.Client(dask_cluster.scheduler_address, set_as_default=False)
    try:
        client.get_task_stream()  # registers the scheduler's task-stream plugin from now on
        yield client
    finally:
        client.close()


def _write_committed_checkpoint(hot_root: Path, catalog_url: str) -> Manifest:
    """What the training side leaves: a committed step directory with its manifest, and the commit
    recorded in the catalog (hot replica READY)."""
    directory = hot_root / RUN / f"step-{STEP}"
    entries = []
    for rank, (name, size) in enumerate(FILES.items()):
        data = os.urandom(size)
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
        entries.append(FileEntry(name, size, checksums.checksum_bytes(data), rank=rank % 2))
    manifest = Manifest(RUN, STEP, 2, "save-dask-1", tuple(entries), metrics={"loss": 1.25})
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    catalog = Catalog.open(catalog_url)
    try:
        catalog.record_committed(
            RUN,
            STEP,
            manifest.save_id,
            world_size=2,
            manifest_checksum=manifest_checksum(directory),
            bytes=manifest.total_bytes,
            file_count=len(entries),
            metrics=dict(manifest.metrics),
            hot_uri=str(directory),
            event_payload={"run": RUN, "step": STEP},
            files=manifest.files,
        )
    finally:
        catalog.dispose()
    return manifest


def _replica_states(catalog_url: str) -> dict[str, ReplicaState]:
    catalog = Catalog.open(catalog_url)
    try:
        (checkpoint,) = [cp for cp in catalog.checkpoints(RUN) if cp.step == STEP]
        return {r.tier: r.state for r in catalog.replicas(checkpoint.id)}
    finally:
        catalog.dispose()


def _ran_on_workers(observer: Any, since: float) -> list[tuple[str, str]]:
    """(task name, worker address) of every task the cluster ran since ``since``."""
    stream = observer.get_task_stream(start=since)
    return [(entry["key"].rsplit("-", 1)[0], entry["worker"]) for entry in stream]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_promote_and_scrub_fan_out_on_a_two_worker_dask_cluster(
    tmp_path: Path, prefect_api: str, dask_cluster: Any, observer: Any
) -> None:
    from prefect.states import State

    from ckptflow.flows.promote import promote
    from ckptflow.flows.promote_part import promote_part
    from ckptflow.flows.scrub import scrub

    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config_path = tmp_path / "ckptflow.yaml"
    address = dask_cluster.scheduler_address
    config_path.write_text(
        _config_text(tmp_path, catalog_url, {"task_runner": "dask", "dask_address": address})
    )
    manifest = _write_committed_checkpoint(tmp_path / "hot", catalog_url)
    worker_pids = observer.run(os.getpid)  # {worker address: pid}
    assert len(worker_pids) == 2 and os.getpid() not in worker_pids.values()

    # this node's part: hot verified and copied to warm, batch by batch on the workers; published
    since = time.time()
    started = time.perf_counter()
    state: State = promote_part(RUN, STEP, str(config_path), return_state=True)
    promote_s = time.perf_counter() - started
    assert state.is_completed(), state
    row = state.result()
    assert row["tier"] == "warm" and row["action"] == "published"
    assert row["files"] == len(FILES) and row["bytes"] == manifest.total_bytes
    # the pipeline's promote: warm verified (no colder tier here)
    assert [r["action"] for r in promote(RUN, STEP, str(config_path))] == ["verified"]
    _, tiers = load(str(config_path))
    warm = tiers["warm"]
    assert isinstance(warm, PosixTier)
    report = warm.verify(RUN, STEP)
    assert report.ok, report.problems
    assert report.manifest is not None and report.manifest.files == manifest.files
    assert _replica_states(catalog_url) == {"hot": ReplicaState.READY, "warm": ReplicaState.READY}

    ran = _ran_on_workers(observer, since)
    counts = Counter(name for name, _ in ran)
    assert counts["copy_batch"] == DEFAULT_MAX_BATCHES, ran
    workers = {worker for _, worker in ran}
    assert workers == set(worker_pids), ran  # both worker processes took batches

    # The task runs are the promote-part flow run's own, recorded by the server, all completed.
    task_runs = _task_runs_of(state.state_details.flow_run_id)
    by_name = Counter(r.name.rsplit("-", 1)[0] for r in task_runs if r.state and r.state.is_completed())
    assert by_name["copy_batch"] == DEFAULT_MAX_BATCHES and "verify_hot_batch" not in by_name

    # scrub: damage the warm copy; a worker's verification finds it, the flow repairs it from hot
    damaged = warm.path(RUN, STEP) / DAMAGED
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    since = time.time()
    started = time.perf_counter()
    rows = scrub(str(config_path))
    scrub_s = time.perf_counter() - started
    assert [(r["tier"], r["verdict"]) for r in rows] == [("warm", "repaired")], rows
    assert DAMAGED in rows[0]["detail"] and "repaired from hot" in rows[0]["detail"]
    assert warm.verify(RUN, STEP).ok
    assert _replica_states(catalog_url)["warm"] == ReplicaState.READY
    scrub_ran = _ran_on_workers(observer, since)
    assert [name for name, _ in scrub_ran] == ["check_replica"], scrub_ran
    assert {worker for _, worker in scrub_ran} <= set(worker_pids)
    print(f"promote on dask: {promote_s:.1f} s; scrub on dask: {scrub_s:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_default_thread_pool_still_promotes_and_scrubs(tmp_path: Path, prefect_api: str) -> None:
    from ckptflow.flows.promote import promote
    from ckptflow.flows.promote_part import promote_part
    from ckptflow.flows.scrub import scrub

    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config_path = tmp_path / "ckptflow.yaml"
    config_path.write_text(_config_text(tmp_path, catalog_url, {"emit_timeout_s": 5}))
    manifest = _write_committed_checkpoint(tmp_path / "hot", catalog_url)
    row = promote_part(RUN, STEP, str(config_path))
    assert (row["tier"], row["action"], row["bytes"]) == ("warm", "published", manifest.total_bytes)
    # Its data time is measured inside the run, by phase, and is part of its wall time.
    assert set(row["data_phases"]) == {"copy", "commit"}  # the copy checks each byte: no re-hash
    assert 0 < row["data_s"] <= row["seconds"]
    assert [r["action"] for r in promote(RUN, STEP, str(config_path))] == ["verified"]
    assert _replica_states(catalog_url) == {"hot": ReplicaState.READY, "warm": ReplicaState.READY}
    assert [(r["tier"], r["verdict"]) for r in scrub(str(config_path))] == [("warm", "ok")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dask_refuses_a_flow_loaded_from_a_file_path_and_names_the_fix(
    tmp_path: Path, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file-path entrypoint loads ckptflow/flows/promote_part.py as top-level module
    ``promote_part``, which Dask workers cannot unpickle: the flow fails with the fix, not with Dask's
    deserialization error."""
    from prefect.flows import load_flow_from_entrypoint

    catalog_url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config_path = tmp_path / "ckptflow.yaml"
    dask = {"task_runner": "dask", "dask_address": "tcp://127.0.0.1:9"}  # refused before any connection
    config_path.write_text(_config_text(tmp_path, catalog_url, dask))
    _write_committed_checkpoint(tmp_path / "hot", catalog_url)
    monkeypatch.setattr(sys, "path", sys.path.copy())  # Prefect's loader prepends the file's directory
    entrypoint = (
        f"{Path(__file__).resolve().parents[3] / 'ckptflow' / 'flows' / 'promote_part.py'}:promote_part"
    )
    by_path = load_flow_from_entrypoint(entrypoint)
    try:
        assert "." not in by_path.fn.__module__  # "promote_part": what a served file-path deployment runs
        with pytest.raises(ValueError, match="module entrypoint.*EntrypointType.MODULE_PATH"):
            by_path(RUN, STEP, str(config_path))
    finally:
        sys.modules.pop(by_path.fn.__module__, None)  # the loader registered it under its file name


def _task_runs_of(flow_run_id: Any) -> list[Any]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list[Any]:
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )

    return asyncio.run(read())
