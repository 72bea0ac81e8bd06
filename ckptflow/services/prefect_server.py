"""A real Prefect server on 127.0.0.1 for development, tests and the demo, started and stopped by pid.

Its state (pid, port, API URL) is kept in ``<dir>/prefect-state.json`` so another process (the CLI's
``services down``) can find and stop it. Its database and settings live in ``<dir>/prefect-home``.

Basic auth is always on: loopback is shared by every account on the machine, and whoever reaches
the API can create flow runs. The ``user:password`` is generated once into ``<dir>/api-auth-string``
(mode 0600) and given to the server as ``PREFECT_SERVER_API_AUTH_STRING``; every client of the stack
gets it as ``PREFECT_API_AUTH_STRING`` (:meth:`PrefectServer.env`, :meth:`PrefectServer.client_settings`)
or reads the file through ``prefect.auth_string_file`` in the stack's ``ckptflow.yaml``.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptflow.policy.secret_file import read_secret_file

STATE_FILE = "prefect-state.json"
AUTH_FILE = "api-auth-string"
AUTH_USER = "ckptflow"


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


def ensure_auth_file(directory: Path) -> Path:
    """``<directory>/api-auth-string``, created 0600 with a new ``ckptflow:<random>`` if missing."""
    path = directory / AUTH_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as out:
        out.write(f"{AUTH_USER}:{secrets.token_urlsafe(32)}\n")
    return path


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


def refuses_anonymous(api_url: str, timeout_s: float = 5.0) -> bool:
    """True if the server answers a request without credentials with 401 (basic auth is on)."""
    request = urllib.request.Request(
        f"{api_url}/flows/count", data=b"{}", method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return False
    except urllib.error.HTTPError as exc:
        return exc.code == 401
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

    @property
    def auth_file(self) -> Path:
        return self.directory / AUTH_FILE

    @property
    def auth_string(self) -> str:
        """``user:password`` of the server's basic auth (read from its 0600 file)."""
        return read_secret_file(self.auth_file, "Prefect auth string").strip()

    def env(self) -> dict[str, str]:
        """Environment of a client process of this server (serving, workers, training, the CLI).
        Pass it without ``PREFECT_API_KEY``: a set API key overrides the auth string (401)."""
        return {**server_env(self.home, self.api_url), "PREFECT_API_AUTH_STRING": self.auth_string}

    def client_settings(self) -> dict[Any, Any]:
        """The same as Prefect settings, for ``prefect.settings.temporary_settings`` in this process."""
        from prefect.settings import (  # noqa: PLC0415 - Prefect only for a client in this process
            PREFECT_API_AUTH_STRING,
            PREFECT_API_KEY,
            PREFECT_API_URL,
            PREFECT_SERVER_ALLOW_EPHEMERAL_MODE,
        )

        return {
            PREFECT_API_URL: self.api_url,
            PREFECT_API_AUTH_STRING: self.auth_string,
            PREFECT_API_KEY: None,
            PREFECT_SERVER_ALLOW_EPHEMERAL_MODE: False,
        }

    @contextmanager
    def reporting(self, extra: dict[Any, Any] | None = None) -> Iterator[PrefectServer]:
        """This process's flow runs, logs and events go to this server inside the block.

        ``extra`` adds Prefect settings (say ``PREFECT_LOGGING_TO_API_ENABLED: False``). Prefect
        keeps one events worker per process whose client is bound to the API URL it first saw, and
        reuses it after the URL changes: events of a run on this server would go to the previous
        one, whose lookups of this server's runs fail. So the process's event and log workers are
        drained (and so discarded) on entry and on exit, and the next event starts a worker bound to
        the server in effect.
        """
        from prefect.settings import temporary_settings  # noqa: PLC0415 - Prefect only for a client

        _drain_prefect_workers()
        with temporary_settings({**self.client_settings(), **(extra or {})}):
            try:
                yield self
            finally:
                _drain_prefect_workers()

    @classmethod
    def start(
        cls, directory: Path, port: int | None = None, startup_timeout_s: float = 120.0
    ) -> PrefectServer:
        """Start a server bound to 127.0.0.1 and wait until ``/api/health`` answers."""
        directory.mkdir(parents=True, exist_ok=True)
        existing = cls.from_state(directory)
        if existing is not None and existing.alive() and healthy(existing.api_url):
            if existing.auth_file.is_file() and refuses_anonymous(existing.api_url):
                return existing
            existing.stop()  # started without auth (by an older ckptflow): restart it with auth on
        port = port or free_port()
        home = directory / "prefect-home"
        home.mkdir(parents=True, exist_ok=True)
        auth = read_secret_file(ensure_auth_file(directory), "Prefect auth string").strip()
        log = open(directory / "prefect-server.log", "ab")  # noqa: SIM115 - owned by the child
        prefect_bin = Path(sys.executable).with_name("prefect")
        proc = subprocess.Popen(
            [str(prefect_bin), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            # The UI asks /ui-settings where its API is; unset, Prefect answers port 4200.
            env={
                **os.environ,
                **server_env(home),
                "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
                "PREFECT_SERVER_API_AUTH_STRING": auth,
            },
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
