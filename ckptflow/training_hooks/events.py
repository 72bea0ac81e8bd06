"""Tell the pipeline a checkpoint is staged: one HTTP POST to Prefect's events API, bounded in time.

Posting the event to ``<api>/events`` directly (rather than through Prefect's client) has three
properties the training process needs: it never starts an ephemeral Prefect server, it is bounded
by a timeout, and a 204 answer confirms delivery, so the outbox row can be marked delivered. When
Prefect is unreachable the event is dropped here and stays undelivered in the outbox, where the
``reconcile`` flow finds it. Nothing here imports Prefect.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime
from typing import Any

from ckptflow.storage.event_schema import STAGED_EVENT, checkpoint_resource, node_resources

log = logging.getLogger("ckptflow.events")

__all__ = ["STAGED_EVENT", "EventPoster", "build_event", "event_id", "node_resources"]


def event_id(name: str, run: str, step: int, save_id: str) -> str:
    """Deterministic: a re-emission of the same commit carries the same id."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{name}/{run}/{step}/{save_id}"))


def build_event(
    name: str,
    run: str,
    step: int,
    save_id: str,
    payload: dict[str, Any],
    related: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The JSON body of one Prefect event about checkpoint (run, step)."""
    return {
        "id": event_id(name, run, step, save_id),
        "occurred": datetime.now(UTC).isoformat(),
        "event": name,
        "resource": checkpoint_resource(run, step),
        "related": list(related or []),
        "payload": payload,
    }


class EventPoster:
    """Posts events to a Prefect server's REST API; returns whether the server accepted them.

    Auth follows Prefect's client convention: ``PREFECT_API_AUTH_STRING`` ("user:pass") becomes a
    basic-auth header. The URL must be explicit: no default, no ephemeral server.
    """

    def __init__(self, api_url: str, timeout_s: float = 5.0, auth_string: str | None = None) -> None:
        if not api_url.startswith(("http://", "https://")):
            raise ValueError(
                f"EventPoster.api_url: must be an http(s) URL of the Prefect API, got {api_url!r}"
            )
        self.api_url = api_url.rstrip("/")
        self.timeout_s = timeout_s
        self._auth = auth_string if auth_string is not None else os.environ.get("PREFECT_API_AUTH_STRING")

    def post(self, events: list[dict[str, Any]]) -> bool:
        body = json.dumps(events).encode()
        request = urllib.request.Request(f"{self.api_url}/events", data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        if self._auth:
            token = base64.b64encode(self._auth.encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                ok = 200 <= response.status < 300
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            log.warning(
                "event not delivered to %s (%s); it stays in the outbox for reconcile", self.api_url, reason
            )
            return False
        if not ok:
            log.warning("Prefect at %s refused the event; it stays in the outbox", self.api_url)
        return ok
