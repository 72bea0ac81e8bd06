"""``python -m ckptflow.peer``: run one node's peer server in the foreground (until SIGTERM/SIGINT).

    python -m ckptflow.peer --hot-root /nvme/ckpt --config /etc/ckptflow/ckptflow.yaml
    python -m ckptflow.peer --hot-root /nvme/ckpt --host 10.1.0.7 --port 8470 \
        --secret-env CKPTFLOW_PEER_SECRET

With ``--config``, host, port and the secret's source come from its ``replication:`` section;
flags given override it. Prints ``ckptflow-peer listening on <url>`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

from ckptflow.peer.auth import PeerSecret
from ckptflow.policy.replication import ReplicationConfig
from ckptflow.storage.peer_endpoint import announce, withdraw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptflow.peer", description=__doc__.splitlines()[0])
    parser.add_argument("--hot-root", required=True, help="this node's hot root (tiers.hot.root)")
    parser.add_argument("--config", help="ckptflow.yaml whose replication: section to use")
    parser.add_argument("--host", help="address to listen on (default: replication.bind_host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: replication.port; 0 = any free port)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--secret-file", help="file holding the shared secret (mode 0600)")
    source.add_argument("--secret-env", help="environment variable holding the shared secret")
    parser.add_argument("--node", help="the name peers know this node by (default: its host name)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--http", default="auto", choices=["auto", "h11", "httptools"], help="uvicorn's parser"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    if args.config:
        from ckptflow.policy.config import load_config

        config = load_config(args.config).replication
    else:
        config = ReplicationConfig()
    if args.secret_file or args.secret_env:
        config = config.model_copy(update={"secret_file": args.secret_file, "secret_env": args.secret_env})
    try:
        secret = PeerSecret.from_config(config)
    except ValueError as exc:
        print(f"ckptflow-peer: {exc}", file=sys.stderr)
        return 2

    from ckptflow.peer.server import PeerServer

    server = PeerServer(
        args.hot_root,
        secret,
        host=args.host if args.host is not None else config.bind_host,
        port=args.port if args.port is not None else config.port,
        log_level=args.log_level,
        http=args.http,
    )
    # Restores on this node's job find the server here, catalog or not (storage/peer_endpoint.py).
    announce(Path(args.hot_root), args.node or socket.gethostname(), server.url)
    # The agent (or a test) waits for this line; flush so a pipe sees it at once.
    print(f"ckptflow-peer listening on {server.url}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on
        return 130
    finally:
        withdraw(Path(args.hot_root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
