"""The agent's peer server: this node's hot root served to its peers, its address announced in the
hot root (:mod:`ckptflow.storage.peer_endpoint`) and registered in the catalog."""

from __future__ import annotations

import logging
from pathlib import Path

from ckptflow.catalog import Catalog
from ckptflow.peer import PeerSecret
from ckptflow.peer.server import PeerServer
from ckptflow.policy.config import load_config
from ckptflow.policy.replication import ReplicationSecretError
from ckptflow.storage.peer_endpoint import announce

log = logging.getLogger("ckptflow.agent")


def parse_bind(value: str | None, default_host: str, default_port: int) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); ValueError naming ``--peer-bind``."""
    if not value:
        return default_host, default_port
    if value.startswith("["):  # [::1]:8470
        host, _, port = value[1:].partition("]")
        port = port.removeprefix(":")
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    else:  # a host name, an IPv4 address or a bare IPv6 address
        return value, default_port
    if not port:
        return host, default_port
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--peer-bind {value!r}: the port must be a number, e.g. 10.1.0.7:8470") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--peer-bind {value!r}: the port must be in 0..65535 (0: any free port)")
    return host, number


def start_peer_server(config_path: str, host: str, bind: str | None) -> PeerServer | None:
    """Start the peer server and register it for ``host``; None (replication off, said so) when no
    secret is configured and the config does not ask for replication. ValueError when it does ask
    (``replication.factor`` > 1) but the secret is unusable, naming the source and the fix."""
    config = load_config(config_path)
    repl = config.replication
    try:
        secret = PeerSecret.from_config(repl)
    except ReplicationSecretError as exc:
        if repl.factor is not None and repl.factor > 1:
            raise ValueError(f"{config_path}: {exc}") from None
        log.warning("peer replication is off on %s: %s", host, exc)
        return None
    bind_host, port = parse_bind(bind, repl.bind_host, repl.port)
    hot_root = Path(config.tiers["hot"].root)
    hot_root.mkdir(parents=True, exist_ok=True)  # an agent may start before the node's first save
    server = PeerServer(hot_root, secret, bind_host, port).start()
    announce(hot_root, host, server.url)  # restore finds it here even without the catalog
    try:
        catalog = Catalog.open(config.catalog)
        try:
            catalog.register_peer(host, server.url)
        finally:
            catalog.dispose()
    except Exception as exc:  # noqa: BLE001 - the node still serves; restores read the announcement
        log.warning(
            "node %s serves its hot root on %s but could not register it in the catalog (%s); restores "
            "find it in %s, replication pushes once the catalog answers",
            host,
            server.url,
            exc,
            hot_root,
        )
    log.info("node %s serves its hot root to peers on %s", host, server.url)
    return server
