"""A real Prefect server on 127.0.0.1 for development, tests and the demo, started and stopped by pid.

Its state (pid, port, API URL) is kept in ``<dir>/prefect-state.json`` so another process (the CLI's
``services down``) can find and stop it. Its database and settings live in ``<dir>/prefect-home``.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STATE_FILE = "prefect-state.json"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """Environment for Prefect processes of this local stack (server, workers, clients)."""
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    headers = {}
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    try:
        request = urllib.request.Request(f"{api_url}/health", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, TimeoutError, OSError):
        return False


@dataclass
class PrefectServer:
    """A running ``prefect server start`` process."""

    directory: Path
    pid: int
    port: int

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def home(self) -> Path:
        return self.directory / "prefect-home"

    def env(self) -> dict[str, str]:
        return server_env(self.home, self.api_url)

    @classmethod
    def start(
        cls, directory: Path, port: int | None = None, startup_timeout_s: float = 120.0
    ) -> PrefectServer:
        """Start a server bound to 127.0.0.1 and wait until ``/api/health`` answers."""
        directory.mkdir(parents=True, exist_ok=True)
        existing = cls.from_state(directory)
        if existing is not None and existing.alive() and healthy(existing.api_url):
            return existing
        port = port or free_port()
        home = directory / "prefect-home"
        home.mkdir(parents=True, exist_ok=True)
        log = open(directory / "prefect-server.log", "ab")  # noqa: SIM115 - owned by the child
        prefect_bin = Path(sys.executable).with_name("prefect")
        proc = subprocess.Popen(
            [str(prefect_bin), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            # The UI asks /ui-settings where its API is; unset, Prefect answers port 4200.
            env={**os.environ, **server_env(home), "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api"},
            start_new_session=True,  # its own process group: stop() takes its children too
        )
        server = cls(directory, proc.pid, port)
        (directory / STATE_FILE).write_text(
            json.dumps({"pid": proc.pid, "port": port, "api_url": server.api_url})
        )
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log_path = directory / "prefect-server.log"
                raise RuntimeError(f"Prefect server exited with code {proc.returncode}; see {log_path}")
            if healthy(server.api_url):
                return server
            time.sleep(0.5)
        server.stop()
        raise RuntimeError(f"Prefect server not healthy after {startup_timeout_s} s; see {directory}")

    @classmethod
    def from_state(cls, directory: Path) -> PrefectServer | None:
        try:
            state = json.loads((directory / STATE_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return cls(directory, int(state["pid"]), int(state["port"]))

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it if it lingers; remove the state file.

        This process's buffered Prefect logs and events are sent first: otherwise they are retried
        against the stopped server until the process exits.
        """
        _drain_prefect_workers()
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            _reap(self.pid)
            time.sleep(0.2)
        if self.alive():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap(self.pid)
        (self.directory / STATE_FILE).unlink(missing_ok=True)


def _drain_prefect_workers() -> None:
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker  # noqa: PLC0415
    from prefect.logging.handlers import APILogWorker  # noqa: PLC0415

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
