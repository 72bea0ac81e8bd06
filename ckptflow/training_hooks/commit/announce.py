"""Tell the pipeline a checkpoint is staged: one HTTP POST to Prefect's events API, bounded in time.

Posting the event to ``<api>/events`` directly (rather than through Prefect's client) has three
properties the training process needs: it never starts an ephemeral Prefect server, it is bounded
by a timeout, and a 204 answer confirms delivery, so the outbox row can be marked delivered. When
Prefect is unreachable the event is dropped here and stays undelivered in the outbox, where the
``reconcile`` flow finds it. Nothing here imports Prefect.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
import uuid
from datetime import UTC, datetime
from typing import Any

from ckptflow.storage.events import checkpoint_resource

log = logging.getLogger("ckptflow.events")


def event_id(name: str, run: str, step: int, save_id: str, occasion: str | None = None) -> str:
    """Deterministic: a re-emission of the same commit carries the same id (Prefect drops the
    repeat). ``occasion`` names a later, distinct announcement of the same commit (a restore that
    wrote parts back onto a node's disk), which gets an id of its own."""
    key = f"{name}/{run}/{step}/{save_id}" + (f"/{occasion}" if occasion else "")
    return str(uuid.uuid5(uuid.NAMESPACE_URL, key))


def build_event(
    name: str,
    run: str,
    step: int,
    save_id: str,
    payload: dict[str, Any],
    related: list[dict[str, str]] | None = None,
    occasion: str | None = None,
) -> dict[str, Any]:
    """The JSON body of one Prefect event about checkpoint (run, step) (``occasion``: see
    :func:`event_id`)."""
    return {
        "id": event_id(name, run, step, save_id, occasion),
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

    :meth:`post` never raises: whatever answers at the URL (nothing, a proxy speaking something
    other than HTTP, a TLS port, a server that hangs up mid-answer), the event stays undelivered
    in the outbox, and the failure is logged and kept in ``last_error``.
    """

    def __init__(self, api_url: str, timeout_s: float = 5.0, auth_string: str | None = None) -> None:
        if not api_url.startswith(("http://", "https://")):
            raise ValueError(
                f"EventPoster.api_url: must be an http(s) URL of the Prefect API, got {api_url!r}"
            )
        try:
            parts = urllib.parse.urlsplit(api_url)
            parts.port  # noqa: B018 - parsing the port is the check (ValueError when out of range)
        except ValueError as exc:
            raise ValueError(
                f"EventPoster.api_url: {api_url!r} is not a valid URL ({exc}); "
                "give the Prefect API as http://HOST:PORT/api"
            ) from None
        if not parts.hostname:
            raise ValueError(f"EventPoster.api_url: {api_url!r} names no host; give http://HOST:PORT/api")
        self.api_url = api_url.rstrip("/")
        self.timeout_s = timeout_s
        self._auth = auth_string if auth_string is not None else os.environ.get("PREFECT_API_AUTH_STRING")
        self.last_error: str | None = None

    def post(self, events: list[dict[str, Any]]) -> bool:
        """POST ``events``; True only if the server answered 2xx. Never raises (see the class)."""
        try:
            return self._post(events)
        except Exception as exc:  # noqa: BLE001 - a notification must never fail a committed save
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "event not delivered to %s (%s); it stays in the outbox for reconcile",
                self.api_url,
                self.last_error,
            )
            return False

    def _post(self, events: list[dict[str, Any]]) -> bool:
        body = json.dumps(events).encode()
        request = urllib.request.Request(f"{self.api_url}/events", data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        if self._auth:
            token = base64.b64encode(self._auth.encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                ok = 200 <= response.status < 300
                response.read()  # a server hanging up inside its answer is a failed delivery too
        except urllib.error.HTTPError as exc:  # an answer, but not 2xx (401: wrong auth string)
            self.last_error = f"HTTP {exc.code} {exc.reason}"
            log.warning(
                "Prefect at %s refused the event (%s); it stays in the outbox", self.api_url, self.last_error
            )
            return False
        except (urllib.error.URLError, http.client.HTTPException, TimeoutError, OSError, ValueError) as exc:
            # URLError: nothing listens; HTTPException: something that does not speak HTTP answered
            # (BadStatusLine, RemoteDisconnected, IncompleteRead); ssl errors are OSErrors.
            reason = getattr(exc, "reason", None) or exc
            self.last_error = f"{type(exc).__name__}: {reason}"
            log.warning(
                "event not delivered to %s (%s); it stays in the outbox for reconcile",
                self.api_url,
                self.last_error,
            )
            return False
        if not ok:
            self.last_error = f"HTTP {response.status}"
            log.warning("Prefect at %s refused the event; it stays in the outbox", self.api_url)
        return ok
