"""The Checkpointer's settings, declared once: :class:`CheckpointOptions` and the rule of each field.

Every training-side setting is written here and nowhere else: its name, type, default, rule and
meaning. Two things are made from this one declaration:

- the Python API: ``ckptflow.training_hooks.CheckpointOptions`` *is* this class (re-exported
  unchanged by ``training_hooks/options.py``); ``__post_init__`` checks every field against its rule;
- ``ckptflow.yaml``'s ``checkpoint:`` section: :class:`ckptflow.policy.config.CheckpointConfig` is
  generated from these fields (same names, types and defaults), and after pydantic's strict type
  check it runs the same rules, so a bound broken in the file is reported in the same words as in
  Python, with the file, line and field. ``event_timeout_s`` is the one option outside that section:
  it bounds the post to the Prefect API, so the file holds it beside that API, as
  ``prefect.emit_timeout_s`` (generated from this field all the same).

Why the dataclass is the declaration and the YAML model the generated one, not the other way round:
the dataclass is the public face users build in their training scripts (keyword-only, frozen, an
``Attributes:`` entry per field, ``ValueError`` naming the field and the rule, ``replace()``), and it
reads as plain source; pydantic validates any annotated type, so building the internal YAML model
from dataclass fields loses nothing, while a dataclass generated from a model would have no source to
read and would raise pydantic's errors instead of these. Why here, in ``policy`` and not in
``training_hooks``: ``policy`` is the leaf both sides import (config models, pure rules), so the
YAML model is built from this class without ``policy`` importing the training side.

A rule is a small object attached to its field (``_option(default, rule)``) whose ``broken_by(value)``
says what the value breaks (``"must be a number of seconds > 0"``) or None. A ``Literal`` field's rule
is its type (the choices are written once, there); ``None`` passes wherever the type allows it.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal, Protocol

_RULE = "ckptflow.rule"  # the key of a field's rule in its dataclass metadata


class Rule(Protocol):
    def broken_by(self, value: Any) -> str | None:
        """What ``value`` breaks (``"must be ..."``), or None when it obeys."""
        ...


@dataclass(frozen=True)
class Number:
    """A number (``noun`` says which: seconds take ints and floats, counts only ints; never a bool)
    above ``gt`` or from ``ge`` (exactly one of them), and at most ``le`` when set. NaN obeys no bound."""

    noun: str
    kinds: tuple[type, ...]
    gt: float | None = None
    ge: float | None = None
    le: float | None = None

    def __post_init__(self) -> None:
        if (self.gt is None) == (self.ge is None):
            raise ValueError(f"Number({self.noun!r}): give exactly one lower bound, gt or ge")

    def broken_by(self, value: Any) -> str | None:
        low = f"must be {self.noun} " + (f"> {self.gt}" if self.gt is not None else f">= {self.ge}")
        if isinstance(value, bool) or not isinstance(value, self.kinds):
            return low
        # "not (in range)", so that NaN, which compares False with everything, breaks the rule.
        if not (value > self.gt if self.gt is not None else value >= self.ge):
            return low
        if self.le is not None and not value <= self.le:
            return f"must be {self.noun} <= {self.le}"
        return None


def seconds(*, gt: float | None = None, ge: float | None = None, le: float | None = None) -> Number:
    return Number("a number of seconds", (int, float), gt=gt, ge=ge, le=le)


def count(*, ge: int, le: int) -> Number:
    return Number("an integer", (int,), ge=ge, le=le)


@dataclass(frozen=True)
class Text:
    """A non-empty string; ``what`` names it in the rule (``"must be a host name or address"``)."""

    what: str

    def broken_by(self, value: Any) -> str | None:
        return None if isinstance(value, str) and value else f"must be {self.what}"


@dataclass(frozen=True)
class Flag:
    """True or False (not 1, not "no": a truthy string would quietly mean True)."""

    def broken_by(self, value: Any) -> str | None:
        return None if isinstance(value, bool) else "must be True or False"


def _option(default: Any, rule: Rule) -> Any:
    """A dataclass field with ``default`` and the ``rule`` every value must obey."""
    return field(default=default, metadata={_RULE: rule})


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a :class:`~ckptflow.training_hooks.Checkpointer` saves, coordinates and restores.

    Attributes:
        on_busy: ``"skip"`` (default) skips a save that falls due while the previous one is still
            being written (counted and logged; every rank agrees); ``"wait"`` blocks until it is done.
        deadline_s: how long, from the start of a save's stall, every node has to commit its part;
            a node that misses it makes that checkpoint ABANDONED (the nodes and ranks are named) and
            training goes on. Never blocks the training loop.
        decision_grace_s: how much longer than ``deadline_s`` a node waits for the coordinator's
            decision before it decides the checkpoint abandoned itself and removes its part (the
            first decision written stands, so both sides always agree). At least 1 s: the
            coordinator builds the decision after the deadline, and a shorter grace makes nodes
            give up while it does, abandoning checkpoints whose every part arrived in time.
        store: the coordination store: ``"auto"`` (the torchrun/``MASTER_ADDR`` store when set,
            else one hosted by rank 0), ``"env"`` (require ``MASTER_ADDR``/``MASTER_PORT``) or
            ``"rank0"``. Always a dedicated client, never the training process group.
        store_host: the address rank 0's store listens on and advertises (``"rank0"``/``"auto"``
            without torchrun); default: 127.0.0.1 when every rank runs on rank 0's host, else its
            fully qualified host name.
        store_timeout_s: the limit of a single store operation (connecting, get, set).
        fetch_timeout_s: at restore, how long the ranks wait for each other while the nodes that
            lack files fetch them from warm or cold (waited on the store, not the process group).
        stale_partial_age_s: at restore, partial directories older than this with no live writer
            are removed from the node's disk.
        quarantine_keep_s: how long a node keeps what restore or a save set aside in its
            ``quarantine/`` (corrupt, unreadable or superseded copies, kept for a person to look
            at) before its next restore removes it (default 7 days); a save that finds the disk
            without room for another checkpoint of the last one's size removes the oldest first.
            Every removal is logged, and recorded in the catalog's event log.
        verify_workers: threads per rank that read and verify files at restore (default 2; at most
            256).
        event_timeout_s: how long the background thread waits for the Prefect API to accept the
            ``ckptflow.checkpoint.staged`` event (at most 120 s).
        reserve_staging: when :meth:`~ckptflow.training_hooks.Checkpointer.restore` loads a
            checkpoint, it loads into the host buffers that saves copy into (allocated then), and
            keeps them: the first save after a resume stalls for the copy alone. ``False``: the
            load's buffers are freed and the first save allocates its own.
    """

    on_busy: Literal["skip", "wait"] = "skip"
    deadline_s: float = _option(600.0, seconds(gt=0))
    decision_grace_s: float = _option(30.0, seconds(ge=1))
    store: Literal["auto", "env", "rank0"] = "auto"
    store_host: str | None = _option(None, Text("a host name or address"))
    store_timeout_s: float = _option(300.0, seconds(gt=0))
    fetch_timeout_s: float = _option(6 * 3600.0, seconds(gt=0))
    stale_partial_age_s: float = _option(60.0, seconds(ge=0))
    quarantine_keep_s: float = _option(7 * 24 * 3600.0, seconds(ge=0))
    verify_workers: int | None = _option(None, count(ge=1, le=256))
    event_timeout_s: float = _option(5.0, seconds(gt=0, le=120))
    reserve_staging: bool = _option(True, Flag())

    def __post_init__(self) -> None:
        for name in self.field_names():
            value = getattr(self, name)
            broken = option_rule_broken(name, value)
            if broken is not None:
                raise ValueError(f"CheckpointOptions.{name}: {broken}, got {value!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def replace(self, **changes: Any) -> CheckpointOptions:
        """A copy with ``changes`` applied (validated again)."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise ValueError(f"CheckpointOptions: unknown option(s) {unknown}; known: {self.field_names()}")
        return CheckpointOptions(**{**{n: getattr(self, n) for n in self.field_names()}, **changes})


@functools.cache
def option_types() -> dict[str, Any]:
    """Each option's type, resolved (``Literal['skip', 'wait']``, ``int | None``), in field order."""
    return typing.get_type_hints(CheckpointOptions)


def option_default(name: str) -> Any:
    return _fields()[name].default


@functools.cache
def _fields() -> dict[str, Field[Any]]:
    return {f.name: f for f in fields(CheckpointOptions)}


def option_rule_broken(name: str, value: Any) -> str | None:
    """What ``value`` breaks as option ``name`` (``"must be ..."``), or None when it obeys.

    The one check of every option, for the dataclass and for ckptflow.yaml alike."""
    kind = option_types()[name]
    if value is None and type(None) in typing.get_args(kind):
        return None
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if value in choices:
            return None
        written = [repr(c) for c in choices]
        return f"must be {', '.join(written[:-1])} or {written[-1]}"
    rule: Rule = _fields()[name].metadata[_RULE]
    return rule.broken_by(value)
