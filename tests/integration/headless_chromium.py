"""A headless Chromium driven over the DevTools protocol (a WebSocket), for the Prefect UI check.

``--dump-dom`` and ``--screenshot`` load one page cold; the UI of a server with basic auth needs its
auth string in the page's ``localStorage`` first (what its login form stores), so the test opens a
page of the UI's origin, stores it, then loads the page to check. The browser runs in its own
process group, killed when the context ends, timeout or not.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from websockets.sync.client import ClientConnection, connect


class Chromium:
    """One headless browser with one page; :meth:`call` sends a DevTools command and returns its result."""

    def __init__(self, binary: str, profile: Path, window: tuple[int, int], startup_timeout_s: float = 60.0):
        profile.mkdir(parents=True, exist_ok=True)
        self.window = window
        self.log = profile / "chromium.log"
        argv = [
            binary,
            "--headless=new",
            "--no-sandbox",  # we run as root in CI
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--no-first-run",
            "--no-default-browser-check",
            f"--user-data-dir={profile}",
            f"--window-size={window[0]},{window[1]}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",  # Chromium picks a free port and writes it to DevToolsActivePort
            "about:blank",
        ]
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._next_id = 0
        try:
            self._ws = self._connect(profile / "DevToolsActivePort", startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _connect(self, port_file: Path, timeout_s: float) -> ClientConnection:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                output = self.log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"chromium exited with {self._proc.returncode}: {output}")
            lines = port_file.read_text().splitlines() if port_file.is_file() else []
            if lines:
                with urllib.request.urlopen(f"http://127.0.0.1:{lines[0]}/json/list", timeout=10) as response:
                    pages = [t for t in json.loads(response.read()) if t.get("type") == "page"]
                if pages:
                    return connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
            time.sleep(0.2)
        raise AssertionError(f"chromium's DevTools endpoint did not come up within {timeout_s} s")

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        self._ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self._ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == self._next_id:  # anything else is an event: not needed here
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, timeout_s: float = 60.0) -> None:
        """Navigate and wait until the new document has loaded (the SPA then keeps fetching, and may
        move to another of its routes, e.g. its login form)."""
        before, origin = self.evaluate("location.href"), "/".join(url.split("/", 3)[:3])
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.evaluate("location.href + ' ' + document.readyState")
            href, _, ready = state.rpartition(" ")
            if ready == "complete" and href != before and href.startswith(origin):
                return
            time.sleep(0.2)
        raise AssertionError(f"{url} did not load within {timeout_s} s (now: {state})")

    def log_in(self, origin: str, auth_string: str) -> None:
        """Store the auth string where the Prefect UI's login form puts it (base64, like ``btoa``)."""
        self.open(f"{origin}/ui-settings")  # a page of the UI's origin: its localStorage is the UI's
        token = base64.b64encode(auth_string.encode()).decode()
        self.evaluate(f"localStorage.setItem('prefect-password', {json.dumps(token)})")

    def text_when(self, ready: Any, timeout_s: float) -> str:
        """The page's visible text once ``ready(text)`` holds, or when ``timeout_s`` is up."""
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.evaluate("document.body ? document.body.innerText : ''") or ""
            if ready(text):
                break
            time.sleep(0.5)
        return text

    def screenshot(self) -> bytes:
        width, height = self.window
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.call("Emulation.setDeviceMetricsOverride", **metrics)
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        ws = getattr(self, "_ws", None)
        if ws is not None:
            ws.close()
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)  # its helpers (zygote, GPU, renderers) too
        except ProcessLookupError:
            pass
        self._proc.wait(timeout=30)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
