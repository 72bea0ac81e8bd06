"""Run names: one path component on every tier, so one rule, checked wherever a run name enters.

A run name becomes a directory (``<hot root>/<run>/``), an S3 key segment (``<prefix>/<run>/``), a
catalog key and part of an event's resource id. It arrives from user code (the Checkpointer), from
manifests on disk, from event payloads that trigger promote, from flow parameters and from the
command line; any of these may carry ``..`` or a ``/`` that would point a tier outside its root. So
every one of them is checked here, with the same rule and the same message.
"""

from __future__ import annotations

import re

MAX_RUN_NAME = 200  # one path component; leaves room under NAME_MAX (255) and S3's 1,024-byte keys
RUN_NAME_RULE = (
    f"a run name is one path component: 1-{MAX_RUN_NAME} ASCII letters, digits, '-', '_' or '.', "
    "starting with a letter or digit (so never '.', '..', a '/' or a leading '-')"
)
_RUN_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_RUN_NAME - 1}}}")


def check_run_name(run: object, field: str = "run") -> str:
    """Return ``run`` if it is a valid run name; otherwise raise ValueError naming ``field``, the
    rule and a name that would pass."""
    if isinstance(run, str) and _RUN_NAME.fullmatch(run):
        return run
    raise ValueError(f"{field}: {run!r} is not a valid run name: {RUN_NAME_RULE}; {_fix(run)}")


def _fix(run: object) -> str:
    if not isinstance(run, str):
        return f"pass a string, not {type(run).__name__}"
    suggestion = re.sub(r"[^A-Za-z0-9._-]+", "-", run).lstrip("-._")[:MAX_RUN_NAME]
    if not suggestion:
        return "choose a name such as 'run-1'"
    return f"rename the run, e.g. {suggestion!r}"
