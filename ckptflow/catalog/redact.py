"""How a catalog URL, and any error about it, may be shown: never with its password.

A PostgreSQL URL may carry a password (``postgresql+psycopg://ckpt:PASSWORD@db/ckptflow``, or
``?password=`` in its query). Every message, log line and echo that names the catalog goes through
:func:`shown_url`; every error text from SQLAlchemy or the driver goes through :func:`redacted`,
which removes the password wherever it appears (a driver may quote its connection string).
"""

from __future__ import annotations

import re

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

MASK = "***"
# scheme://user:<up to the last '@' before a space>: may over-mask a URL with a later '@', never under-.
_USERINFO_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)\S*@")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)[^&\s]*", re.IGNORECASE)


def shown_url(url: object) -> str:
    """``url`` as it may be printed or logged: any password replaced by ``***``, even in a URL that
    does not parse."""
    text = str(url)
    try:
        text = make_url(text).render_as_string(hide_password=True)
    except (ArgumentError, ValueError, TypeError):
        pass  # not a URL SQLAlchemy reads: the patterns below still mask what looks like a password
    # Also after rendering: SQLAlchemy ends the password at the first '@', a driver may not.
    return _QUERY_PASSWORD.sub(rf"\g<head>{MASK}", _USERINFO_PASSWORD.sub(rf"\g<head>{MASK}@", text))


def _passwords(url: str) -> list[str]:
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError, TypeError):
        return []
    found = [parsed.password] if parsed.password else []
    query = parsed.query.get("password")
    found += [query] if isinstance(query, str) else list(query or ())
    return [str(p) for p in found if p]


def redacted(text: str, url: str) -> str:
    """``text`` (an error message) with ``url``'s password, and any URL in it, masked."""
    for password in _passwords(url):
        text = text.replace(password, MASK)
    return _QUERY_PASSWORD.sub(rf"\g<head>{MASK}", _USERINFO_PASSWORD.sub(rf"\g<head>{MASK}@", text))
