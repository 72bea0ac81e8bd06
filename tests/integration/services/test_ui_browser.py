"""The Prefect UI of the local stack, loaded in a real headless Chromium, asks for the auth string and,
given it, lists every ckptflow deployment.

The stack is the one ``ckptflow services up`` starts (SeaweedFS, a Prefect server with basic auth on a
free port, the process serving the deployments). The UI is a single-page app that fetches its API URL
from ``/ui-settings`` and then the deployments from that API with the auth string its login form
stored, so a page that renders the names proves the whole path a user's browser takes. Chromium comes
from ``scripts/chromium.sh`` (``CKPTFLOW_CHROMIUM``) and is driven over the DevTools protocol
(``headless_chromium.py``).

``CKPTFLOW_UPDATE_SCREENSHOT=1`` copies the screenshot to ``docs/img/prefect-deployments.png`` (the
README shows it); without it the test writes nothing into the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from headless_chromium import Chromium

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

REPO = Path(__file__).resolve().parents[3]
SCREENSHOT = REPO / "docs" / "img" / "prefect-deployments.png"
DEPLOYMENTS = [
    PROMOTE_DEPLOYMENT,
    RECONCILE_DEPLOYMENT,
    SCRUB_DEPLOYMENT,
    RETENTION_DEPLOYMENT,
    DRILL_DEPLOYMENT,
]
WINDOW = (1400, 900)
LOAD_TIMEOUT_S = 90  # the SPA loads its bundle, then /ui-settings, then the deployments (slow when loaded)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NO_API = "Can't connect to Server API"


@pytest.fixture(scope="module")
def stack(shared_stack: local_stack.Stack) -> local_stack.Stack:
    return shared_stack  # up() returned once every deployment was registered on the server


@pytest.fixture(scope="module")
def ui_settings(stack: local_stack.Stack) -> dict[str, Any]:
    with urllib.request.urlopen(f"{stack.prefect.ui_url}/ui-settings", timeout=10) as response:
        return json.loads(response.read())


def _browser(profile: Path) -> Chromium:
    assert CHROMIUM is not None
    return Chromium(CHROMIUM, profile, WINDOW)


def _page_urls(stack: local_stack.Stack, settings: dict[str, Any]) -> dict[str, str]:
    """The deployments page of every UI the server mounts (Prefect 3.9: v1 at /, v2 at /v2)."""
    urls = {}
    for ui in settings["available_uis"]:
        base = settings[f"{ui}_base_url"].rstrip("/")
        urls[ui] = f"{stack.prefect.ui_url}{base}/deployments"
    return urls


def _lists_every_deployment(text: str) -> bool:
    return all(name in text for name in DEPLOYMENTS) or NO_API in text


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
    assert ui_settings["auth"] == "BASIC", ui_settings  # the UI knows to ask for the auth string


def test_without_the_auth_string_the_ui_shows_its_login_form_and_no_deployment(
    stack: local_stack.Stack, ui_settings: dict[str, Any], tmp_path: Path
) -> None:
    url = _page_urls(stack, ui_settings)[ui_settings["default_ui"]]
    with _browser(tmp_path / "profile") as browser:
        browser.open(url)
        text = browser.text_when(lambda t: "Login" in t, LOAD_TIMEOUT_S)
        assert "Login" in text and browser.evaluate("!!document.querySelector('input[type=password]')"), text
        assert not [name for name in DEPLOYMENTS if name in text], text[:2000]


def test_every_deployment_is_listed_on_the_deployments_page(
    stack: local_stack.Stack, ui_settings: dict[str, Any], tmp_path: Path
) -> None:
    urls = _page_urls(stack, ui_settings)
    assert urls, f"the server mounts no UI: {ui_settings}"
    for ui, url in urls.items():
        with _browser(tmp_path / f"profile-{ui}") as browser:
            browser.log_in(stack.prefect.ui_url, stack.prefect.auth_string)
            browser.open(url)
            text = browser.text_when(_lists_every_deployment, LOAD_TIMEOUT_S)
        assert NO_API not in text, f"{ui} UI at {url} cannot reach its API: {text[:1000]}"
        missing = [name for name in DEPLOYMENTS if name not in text]
        assert not missing, f"{ui} UI at {url} does not list {missing}; page text: {text[:2000]}"


def test_screenshot_of_the_deployments_page(
    stack: local_stack.Stack, ui_settings: dict[str, Any], tmp_path: Path
) -> None:
    url = _page_urls(stack, ui_settings)[ui_settings["default_ui"]]  # where the stack's UI link lands
    with _browser(tmp_path / "profile") as browser:
        browser.log_in(stack.prefect.ui_url, stack.prefect.auth_string)
        browser.open(url)
        text = browser.text_when(_lists_every_deployment, LOAD_TIMEOUT_S)
        assert all(name in text for name in DEPLOYMENTS), text[:2000]
        time.sleep(2.0)  # the table's last paint (icons, schedule column) after the text is there
        data = browser.screenshot()
    assert _png_size(data) == WINDOW
    assert len(data) > 20_000, f"{len(data)} bytes: a blank page?"
    png = tmp_path / "deployments.png"
    png.write_bytes(data)
    if os.environ.get("CKPTFLOW_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, SCREENSHOT)
