"""Where a node's peer server listens, announced in the node's own hot root.

The node's agent writes ``<hot root>/.ckptflow-peer.json`` (``{"host", "url"}``) once its peer server
listens (:func:`announce`), and registers the same address in the catalog. Restore reads the file on
each node and the ranks exchange what they read (:func:`announced`), so a restore finds its peers
even when the catalog is down or the agent could not register yet: only a node whose agent is not
running is unreachable, and "unreachable now" never sets anything aside. A stale file (an agent
killed since) names an address that refuses connections: the fetch tries the next place.
"""

from __future__ import annotations

import json
from pathlib import Path

from ckptflow.storage.atomic import write_file_atomic
from ckptflow.storage.layout import PEER_ENDPOINT_NAME


def announce(hot_root: Path, host: str, url: str) -> Path:
    """Write the address ``url`` of ``host``'s peer server into ``hot_root`` (atomically)."""
    path = Path(hot_root) / PEER_ENDPOINT_NAME
    write_file_atomic(path, json.dumps({"host": host, "url": url}).encode())
    return path


def withdraw(hot_root: Path) -> None:
    """The agent stops serving: its address is no longer announced."""
    (Path(hot_root) / PEER_ENDPOINT_NAME).unlink(missing_ok=True)


def announced(hot_root: Path) -> tuple[str, str] | None:
    """(host, url) announced in ``hot_root``, or None (no agent has announced one, or the file is
    unreadable or malformed: read as no announcement, never an error)."""
    try:
        body = json.loads((Path(hot_root) / PEER_ENDPOINT_NAME).read_bytes())
        host, url = body["host"], body["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(host, str) and isinstance(url, str) and url.startswith(("http://", "https://"))):
        return None
    return host, url
