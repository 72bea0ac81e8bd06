"""A pipeline test bench: the local stack's SeaweedFS (auth on) and Prefect server (auth on), no
served deployments, so every flow run is one the test starts (in this process, or in a process of
its own through flow_process.py), and checkpoints saved in this process straight onto the hot tier.
Shared by the tests of leases and of flows that must not fight each other."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from ckptflow.catalog import Catalog
from ckptflow.services import stack as local_stack

FLOW_PROCESS = Path(__file__).with_name("flow_process.py")


@dataclass
class Bench:
    stack: local_stack.Stack
    config: Path
    work: Path

    @property
    def body(self) -> dict[str, Any]:
        return yaml.safe_load(self.config.read_text())

    def catalog(self) -> Catalog:
        return Catalog.open(self.body["catalog"])

    def warm_root(self) -> Path:
        return Path(self.body["tiers"]["warm"]["root"])

    def s3_keys(self, run: str, step: int) -> list[str]:
        """Every object under the step's prefix on the cold tier."""
        client = self.stack.seaweed.client()
        prefix = f"runs/{run}/step-{step}/"
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=local_stack.BUCKET, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def uploads(self, run: str) -> list[dict[str, Any]]:
        client = self.stack.seaweed.client()
        got = client.list_multipart_uploads(Bucket=local_stack.BUCKET).get("Uploads", [])
        return [u for u in got if f"/{run}/" in u["Key"]]

    def fork(self, work: Path, **changes: Any) -> Bench:
        """The same servers with a ckptflow.yaml of its own under ``work``: its own catalog and hot
        and warm roots (the S3 bucket is shared; runs keep their keys apart), so one module's
        checkpoints are not another's pipeline work."""
        work.mkdir(parents=True, exist_ok=True)
        made = Bench(self.stack, work / "ckptflow.yaml", work)
        made.config.write_text(self.config.read_text())
        made.configure(
            **{
                "catalog": f"sqlite:///{work / 'catalog.db'}",
                "tiers.hot.root": str(work / "hot"),
                "tiers.warm.root": str(work / "warm"),
                **changes,
            }
        )
        return made

    def seaweed_write_bytes(self) -> int:
        """Bytes the SeaweedFS server process has written to its disk (``/proc/<pid>/io``): what
        reached S3, counted by the kernel."""
        return _write_bytes(self.stack.seaweed.pid)

    def configure(self, **changes: Any) -> None:
        """Change fields of the bench's ckptflow.yaml (dotted keys), in place."""
        body = self.body
        for dotted, value in changes.items():
            node = body
            *parents, leaf = dotted.split(".")
            for key in parents:
                node = node[key]
            node[leaf] = value
        self.config.write_text(yaml.safe_dump(body))
        time.sleep(0.01)  # a new mtime: tasks.tiers.load rebuilds the tiers from the new file


def _write_bytes(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "write_bytes":
            return int(value)
    raise RuntimeError(f"/proc/{pid}/io has no write_bytes")


@contextmanager
def bench(work: Path, **changes: Any) -> Iterator[Bench]:
    """Start the bench under ``work`` (SeaweedFS, Prefect, a ckptflow.yaml without events from
    training, short leases); stop it after. Flows report to it inside :func:`reporting`."""
    running = local_stack.up(work / "stack", serve=False)
    config = work / "ckptflow.yaml"
    config.write_text(running.config_path.read_text())
    made = Bench(running, config, work)
    made.configure(**{"prefect.api_url": None, "promote.lease_ttl_s": 3.0, **changes})
    try:
        yield made
    finally:
        local_stack.down(work / "stack")


@contextmanager
def reporting(made: Bench) -> Iterator[Bench]:
    """This process's flows report to the bench's Prefect server (basic auth) inside the block."""

    with made.stack.prefect.reporting():
        yield made


def save_checkpoint(made: Bench, run: str, step: int, mib: int) -> int:
    """Commit a checkpoint of about ``mib`` MiB of (random) weights at ``step`` onto the hot tier,
    recorded in the catalog; returns its total bytes."""
    from ckptflow.storage.manifest import read_manifest
    from ckptflow.training_hooks import Checkpointer, ModelState

    torch.manual_seed(step)
    model = torch.nn.Linear(1024, max(1, mib * 256), bias=False)  # 1024 x 256 float32 = 1 MiB
    state = {"app": ModelState(model)}
    with Checkpointer.from_config(run, made.config) as ckpt:
        assert ckpt.save(step, state)
        ckpt.wait()
        directory = ckpt.run_dir / f"step-{step}"
    return read_manifest(directory).total_bytes


def start_flow(
    made: Bench,
    out: Path,
    flow: str,
    args: list[Any],
    throttle_mib_s: float | None = None,
    start_when: Path | None = None,
    throttle_after_mib: float = 0.0,
) -> subprocess.Popen[bytes]:
    """Run ``flow`` (module:function) with ``args`` in a process of its own (flow_process.py); with
    ``start_when``, it calls the flow once that file exists (``out`` with suffix ``.ready`` says
    it is ready to)."""
    argv = [sys.executable, str(FLOW_PROCESS), str(out), flow, json.dumps(args)]
    if throttle_mib_s is not None:
        argv += ["--throttle-mib-s", str(throttle_mib_s), "--throttle-after-mib", str(throttle_after_mib)]
    if start_when is not None:
        argv += ["--start-when", str(start_when)]
    log = open(out.with_suffix(".log"), "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=local_stack.client_env(made.stack.prefect)
    )


def finished(proc: subprocess.Popen[bytes], out: Path, timeout_s: float = 300) -> dict[str, Any]:
    """The report of a flow process, once it exited (AssertionError with its log if it wrote none)."""
    proc.wait(timeout=timeout_s)
    if not out.is_file():
        raise AssertionError(f"{out} missing; log:\n{out.with_suffix('.log').read_text()[-4000:]}")
    return json.loads(out.read_text())


def wait_for(predicate: Any, timeout_s: float, what: str, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s} s")
