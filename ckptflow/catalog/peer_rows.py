"""Where each node's agent serves its hot tier to peers (``PeerEndpoint``): registered at agent
start, stamped on each heartbeat, read by restore and replication to reach another node's disk."""

from __future__ import annotations

from collections.abc import Iterable

from sqlmodel import col, select

from ckptflow.catalog.models import PeerEndpoint, utcnow
from ckptflow.catalog.rows import locked, log_event
from ckptflow.catalog.sessions import Sessions


def register_peer(catalog: Sessions, host: str, url: str) -> None:
    """Record (or replace) where ``host``'s agent serves peers; an unchanged url only stamps
    ``seen_at`` (and logs nothing)."""
    now = utcnow()
    with catalog.write_session() as session:
        row = session.exec(locked(select(PeerEndpoint).where(PeerEndpoint.host == host))).first()
        if row is None:
            session.add(PeerEndpoint(host=host, url=url, registered_at=now, seen_at=now))
            log_event(session, "peer.registered", "", None, now, host=host, url=url)
        else:
            if row.url != url:
                row.url, row.registered_at = url, now
                log_event(session, "peer.registered", "", None, now, host=host, url=url)
            row.seen_at = now
            session.add(row)


def peer_endpoints(catalog: Sessions, hosts: Iterable[str] | None = None) -> dict[str, str]:
    """host -> peer url of every registered agent (or only of ``hosts``)."""
    with catalog.read_session() as session:
        stmt = select(PeerEndpoint)
        if hosts is not None:
            stmt = stmt.where(col(PeerEndpoint.host).in_(list(hosts)))
        return {row.host: row.url for row in session.exec(stmt)}
