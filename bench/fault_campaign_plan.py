"""The fault campaign's trials, drawn from a seed (bench/fault_campaign.py): pure, no processes.

Trial ``i`` of seed ``s`` is drawn from ``random.Random(s + i)`` alone, so ``--only-trial i`` replays
it. A trial is two or three launches of one job on 2-3 simulated nodes (each its own disk and host):

1. ``first``: from empty disks, train to ``stop_at`` saving every ``SAVE_EVERY`` steps, with at most
   one of the first launch's faults (a node killed during a save or the commit, the coordination
   store killed, a node past the deadline) and possibly the catalog down;
2. ``resume``: the same machines, possibly in another order (swapped node ranks), a killed node's
   disk possibly emptied (a replacement, possibly a new host whose name sorts first); possibly a
   restore fault (a node killed during the restore, EIO on a file of the newest checkpoint); it
   trains to ``STEPS``;
3. ``again`` (only after a node was killed during the resume's restore): train to ``STEPS``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

STEPS = 10
SAVE_EVERY = 2

FAULT_KINDS = (
    "kill-save",
    "kill-commit",
    "kill-restore",
    "swap",
    "store-kill",
    "eio",
    "deadline",
    "catalog-down",
)
FIRST_LAUNCH = ("kill-save", "kill-commit", "store-kill", "deadline")  # at most one per trial
AT_RESTORE = ("kill-restore", "eio")  # at most one per trial
# A node is paused (then killed) at one of these moments of a save, of the commit, of a restore;
# "write-file" is the first file a rank writes (its partial directory exists, no bytes yet).
SAVE_MOMENTS = ("writing", "write-file", "waiting", "part committed")
COMMIT_MOMENTS = ("deciding", "manifest", "catalog")
COORDINATOR_MOMENTS = ("deciding", "catalog")  # only rank 0 passes there
RESTORE_MOMENTS = ("restore:inventory", "restore:load")
FETCH_MOMENT = "restore:fetch"  # only reached when a node lacks files: after a swap or a replacement
STORE_MOMENTS = ("writing", "part committed", "deciding", "manifest")  # on the coordinator

# The quick set (CI): every kind at least once, in compatible pairs.
QUICK = (
    ("kill-save", "swap"),
    ("kill-commit", "catalog-down"),
    ("store-kill", "eio"),
    ("deadline", "kill-restore"),
)


@dataclass(frozen=True)
class Fault:
    kind: str
    moment: str | None = None  # the phase a node is paused at (then killed), or the store killed
    step: int | None = None  # the save it happens in (None: a restore)
    node: int | None = None  # the node's rank in the launch it happens in

    def describe(self) -> str:
        detail = [
            v
            for v in (
                self.moment,
                f"step {self.step}" if self.step is not None else None,
                f"node {self.node}" if self.node is not None else None,
            )
            if v
        ]
        return f"{self.kind}({', '.join(detail)})" if detail else self.kind


@dataclass(frozen=True)
class TrialPlan:
    index: int
    seed: int
    nodes: int
    nproc: int
    store: str  # "env": a TCPStore the campaign hosts; "auto": torchrun's
    stop_at: int  # the first launch trains steps [0, stop_at)
    faults: tuple[Fault, ...]
    teardown: str  # after a node is killed, the others: "at once" killed, or "let react" (bounded)
    replace: bool  # a node killed in the first launch comes back with an empty disk
    new_host: bool  # ... as a new host named "a-new", which sorts first (its node rank changes)
    warm: bool  # the pipeline promoted a committed step to warm after the first launch
    replicas: bool  # each node's part of a committed step was replicated to the next node
    rotate: int  # swap: the resume's node order, rotated by this much
    quick: bool = False

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(f.kind for f in self.faults)

    def fault(self, kind: str) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind), None)

    @property
    def configuration(self) -> str:
        """What the reference run depends on."""
        return f"{self.nodes}x{self.nproc}-steps{STEPS}"

    def describe(self) -> str:
        extras = [
            f"store {self.store}",
            f"stop {self.stop_at}",
            *(["warm"] if self.warm else []),
            *(["replicas"] if self.replicas else []),
            *([f"replace{' by a-new' if self.new_host else ''}"] if self.replace and self.kills() else []),
            *([f"teardown {self.teardown}"] if self.killed_first() else []),
        ]
        faults = " + ".join(f.describe() for f in self.faults)
        return f"{self.nodes}x{self.nproc} {faults} [{', '.join(extras)}]"

    def kills(self) -> bool:
        return any(f.kind in ("kill-save", "kill-commit", "kill-restore") for f in self.faults)

    def killed_first(self) -> Fault | None:
        return next((f for f in self.faults if f.kind in ("kill-save", "kill-commit")), None)


def _kinds(rng: random.Random) -> tuple[str, ...]:
    count = 1 if rng.random() < 0.3 else 2
    while True:
        kinds = tuple(rng.sample(FAULT_KINDS, count))
        if sum(k in FIRST_LAUNCH for k in kinds) > 1 or sum(k in AT_RESTORE for k in kinds) > 1:
            continue
        if "eio" in kinds and "swap" in kinds:
            # After a swap no node reads its own disk's files at restore (each fetches its new ranks'
            # part from the other node's peer server, whose reads have no hook): the EIO could not fire.
            continue
        return tuple(sorted(kinds, key=FAULT_KINDS.index))


def draw(index: int, seed: int, nodes: int | None = None, quick: bool = False) -> TrialPlan:
    """Trial ``index`` of ``seed`` (``nodes``: 2 or 3 forced, else drawn; ``quick``: the CI set)."""
    rng = random.Random(seed + index)
    kinds = QUICK[index % len(QUICK)] if quick else _kinds(rng)
    count = 2 if quick else (nodes or rng.choice((2, 2, 3)))
    nproc = 1 if (quick or count == 3) else rng.choice((1, 2))
    stop_at = rng.choice((6, 7, 8))
    saves = [s for s in range(4, stop_at + 1, SAVE_EVERY)]
    store = "env" if "store-kill" in kinds else rng.choice(("env", "auto"))
    teardown = rng.choice(("at once", "let react"))
    replace = rng.random() < 0.5
    new_host = rng.random() < 0.5 and "eio" not in kinds  # a renumbered node reads no file of its own
    warm = rng.random() < 0.5
    replicas = rng.random() < 0.3
    rotate = rng.randrange(1, count)
    faults = []
    for kind in kinds:
        if kind == "kill-save":
            faults.append(Fault(kind, rng.choice(SAVE_MOMENTS), rng.choice(saves), rng.randrange(count)))
        elif kind == "kill-commit":
            moment = rng.choice(COMMIT_MOMENTS)
            node = 0 if moment in COORDINATOR_MOMENTS else rng.randrange(count)
            faults.append(Fault(kind, moment, rng.choice(saves), node))
        elif kind == "store-kill":
            faults.append(Fault(kind, rng.choice(STORE_MOMENTS), rng.choice(saves)))
        elif kind == "deadline":
            faults.append(Fault(kind, None, rng.choice(saves), rng.randrange(count)))
        elif kind == "kill-restore":
            fetching = "swap" in kinds or (replace and any(k in kinds for k in ("kill-save", "kill-commit")))
            moments = (*RESTORE_MOMENTS, FETCH_MOMENT) if fetching else RESTORE_MOMENTS
            faults.append(Fault(kind, rng.choice(moments), None, rng.randrange(count)))
        else:
            faults.append(Fault(kind))
    return TrialPlan(
        index=index,
        seed=seed + index,
        nodes=count,
        nproc=nproc,
        store=store,
        stop_at=stop_at,
        faults=tuple(faults),
        teardown=teardown,
        replace=replace,
        new_host=new_host,
        warm=warm,
        replicas=replicas,
        rotate=rotate,
        quick=quick,
    )
