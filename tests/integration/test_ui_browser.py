"""The Prefect UI of the local stack, loaded in a real headless Chromium, lists every ckptflow deployment.

The stack is the one ``ckptflow services up`` starts (SeaweedFS, a Prefect server on a free port, the
process serving the deployments). The UI is a single-page app that fetches its API URL from
``/ui-settings`` and then the deployments from that API, so a page that renders the names proves the
whole path a user's browser takes. Chromium comes from ``scripts/chromium.sh`` (``CKPTFLOW_CHROMIUM``).

``CKPTFLOW_UPDATE_SCREENSHOT=1`` copies the screenshot to ``docs/img/prefect-deployments.png`` (the
README shows it); without it the test writes nothing into the repository.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptflow.flows.deployments import (
    DRILL_DEPLOYMENT,
    PROMOTE_DEPLOYMENT,
    RECONCILE_DEPLOYMENT,
    RETENTION_DEPLOYMENT,
    SCRUB_DEPLOYMENT,
)
from ckptflow.services import stack as local_stack

CHROMIUM = os.environ.get("CKPTFLOW_CHROMIUM") or shutil.which("chromium")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium: run scripts/chromium.sh (export CKPTFLOW_CHROMIUM=$(scripts/chromium.sh))",
    ),
]

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "img" / "prefect-deployments.png"
DEPLOYMENTS = [
    PROMOTE_DEPLOYMENT,
    RECONCILE_DEPLOYMENT,
    SCRUB_DEPLOYMENT,
    RETENTION_DEPLOYMENT,
    DRILL_DEPLOYMENT,
]
WINDOW = (1400, 900)
# The SPA loads its bundle, then /ui-settings, then the deployments: virtual time lets it finish without
# real waiting; a slower machine gets a longer budget on the next try.
BUDGETS_MS = (20_000, 40_000, 60_000)
RUN_TIMEOUT_S = 120
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NO_API = "Can't connect to Server API"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_stack.Stack]:
    directory = tmp_path_factory.mktemp("uistack")
    try:
        # up() returns once every deployment is registered on the server.
        yield local_stack.up(directory, serve=True, reconcile_interval_s=3600)
    finally:
        local_stack.down(directory)


@pytest.fixture(scope="module")
def ui_settings(stack: local_stack.Stack) -> dict[str, Any]:
    with urllib.request.urlopen(f"{stack.prefect.ui_url}/ui-settings", timeout=10) as response:
        return json.loads(response.read())


def _kill_group(pgid: int) -> None:
    # Chromium's helpers (zygote, GPU, renderers) share the process group of the browser we started.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run headless Chromium once; its whole process group is killed on return, timeout or not."""
    assert CHROMIUM is not None
    argv = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",  # we run as root in CI
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--no-first-run",
        "--no-default-browser-check",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        *args,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.communicate()
        raise AssertionError(f"chromium did not finish within {RUN_TIMEOUT_S} s: {argv}") from None
    finally:
        _kill_group(proc.pid)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _page_urls(stack: local_stack.Stack, settings: dict[str, Any]) -> dict[str, str]:
    """The deployments page of every UI the server mounts (Prefect 3.9: v1 at /, v2 at /v2)."""
    urls = {}
    for ui in settings["available_uis"]:
        base = settings[f"{ui}_base_url"].rstrip("/")
        urls[ui] = f"{stack.prefect.ui_url}{base}/deployments"
    return urls


def _visible_text(dom: str) -> str:
    without_code = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.DOTALL | re.IGNORECASE)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", without_code))


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", "not a PNG file"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_ui_is_configured_to_call_this_server(stack: local_stack.Stack, ui_settings: dict[str, Any]) -> None:
    # The server listens on a free port; the UI must not fall back to Prefect's default port 4200.
    assert ui_settings["api_url"] == stack.prefect.api_url, (
        f"/ui-settings sends browsers to {ui_settings['api_url']}, not {stack.prefect.api_url}: start "
        "the Prefect server with PREFECT_UI_API_URL set to its API URL (ckptflow/services/prefect_server.py)"
    )


def test_every_deployment_is_listed_on_the_deployments_page(
    stack: local_stack.Stack, ui_settings: dict[str, Any], tmp_path: Path
) -> None:
    urls = _page_urls(stack, ui_settings)
    assert urls, f"the server mounts no UI: {ui_settings}"
    for ui, url in urls.items():
        missing: list[str] = list(DEPLOYMENTS)
        text = ""
        for attempt, budget in enumerate(BUDGETS_MS):
            result = _chromium(
                tmp_path / f"profile-{ui}-{attempt}", f"--virtual-time-budget={budget}", "--dump-dom", url
            )
            assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
            text = _visible_text(result.stdout.decode(errors="replace"))
            assert NO_API not in text, f"{ui} UI at {url} cannot reach its API: {text[:1000]}"
            missing = [name for name in DEPLOYMENTS if name not in text]
            if not missing:
                break
        assert not missing, f"{ui} UI at {url} does not list {missing}; page text: {text[:2000]}"


def test_screenshot_of_the_deployments_page(
    stack: local_stack.Stack, ui_settings: dict[str, Any], tmp_path: Path
) -> None:
    url = _page_urls(stack, ui_settings)[ui_settings["default_ui"]]  # where the stack's UI link lands
    png = tmp_path / "deployments.png"
    for attempt, budget in enumerate(BUDGETS_MS):
        result = _chromium(
            tmp_path / f"profile-{attempt}", f"--virtual-time-budget={budget}", f"--screenshot={png}", url
        )
        if result.returncode == 0 and png.is_file() and png.stat().st_size > 0:
            break
    assert png.is_file(), result.stderr.decode(errors="replace")[-3000:]
    data = png.read_bytes()
    assert _png_size(data) == WINDOW
    assert len(data) > 20_000, f"{len(data)} bytes: a blank page?"
    if os.environ.get("CKPTFLOW_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, SCREENSHOT)
