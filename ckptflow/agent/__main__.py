"""``python -m ckptflow.agent --config ckptflow.yaml [--node HOST] [--peer-bind HOST[:PORT]]
[--on-commit watch|event]``: start this node's peer server (when a replication secret is
configured), delete the housekeeping runs that came due while no agent served them
(agent/missed_runs.py), start watching this node's disk for committed parts (``--on-commit watch``,
the default: agent/commit_watch.py; each commit starts promote-part and replicate-part at once in
this process, agent/part_runs.py), catch up once (node-housekeeping: what this node missed while no
agent listened), then serve this node's deployments (blocks for the life of the job; stop it with
SIGTERM).

With ``--on-commit event`` the staged event triggers the node's deployments through the Prefect
server instead, seconds later (bench/agent_path.py compares the two routes); the deployments exist
either way (runnable by hand from the UI)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from prefect import serve

from ckptflow.agent.commit_watch import CommitWatcher
from ckptflow.agent.missed_runs import forget_missed_runs
from ckptflow.agent.node_deployments import deployment_name, node_deployments
from ckptflow.agent.part_runs import PartRuns
from ckptflow.agent.peer_service import start_peer_server
from ckptflow.flows.node_housekeeping import node_housekeeping
from ckptflow.flows.pinned import CONFIG_DIR_ENV
from ckptflow.pipeline.part import this_host
from ckptflow.policy.config import load_config
from ckptflow.storage.peer_endpoint import withdraw

log = logging.getLogger("ckptflow.agent")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Serve this node's ckptflow deployments (blocks).")
    ap.add_argument("--config", required=True, help="path to ckptflow.yaml, as this node sees it")
    ap.add_argument("--node", default=None, help="this node's host name (default: socket.gethostname())")
    ap.add_argument("--housekeeping-interval-s", type=int, default=300)
    ap.add_argument("--limit", type=int, default=4, help="flow runs at once on this node")
    ap.add_argument(
        "--poll-interval-s",
        type=float,
        default=5.0,
        help="how often the agent asks the server for its runs (Prefect's default is 10 s: a part's "
        "promotion and replication then start up to 10 s after its event's run is created)",
    )
    ap.add_argument(
        "--no-catch-up",
        dest="catch_up",
        action="store_false",
        help="do not run node-housekeeping once before serving",
    )
    ap.add_argument(
        "--peer-bind",
        default=None,
        metavar="HOST[:PORT]",
        help="where this node's peer server listens (default: replication.bind_host and .port)",
    )
    ap.add_argument(
        "--on-commit",
        choices=["watch", "event"],
        default="watch",
        help="how promote-part and replicate-part start: 'watch' (default): the agent sees its part "
        "committed on its disk and starts them itself, within a poll interval; 'event': the staged "
        "event triggers the node's deployments through the Prefect server (seconds after the commit)",
    )
    ap.add_argument(
        "--commit-watch-interval-s", type=float, default=0.2, help="how often the disk is looked at (watch)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = Path(args.config).resolve()
    # Served runs inherit this environment: their config must be this directory's (flows/pinned.py).
    os.environ.setdefault(CONFIG_DIR_ENV, str(config.parent))
    host = args.node or this_host()
    try:
        peer_server = start_peer_server(str(config), host, args.peer_bind)
    except (ValueError, OSError) as exc:
        print(f"ckptflow agent: {exc}", file=sys.stderr)
        return 2
    interval = args.housekeeping_interval_s
    replicate = peer_server is not None
    watcher: CommitWatcher | None = None
    part_runs: PartRuns | None = None
    if args.on_commit == "watch":  # before the catch-up: a commit made meanwhile is not missed
        part_runs = PartRuns(str(config), host, replicate=replicate, limit=args.limit)
        hot_root = Path(load_config(str(config)).tiers["hot"].root)
        hot_root.mkdir(parents=True, exist_ok=True)
        watcher = CommitWatcher(hot_root, part_runs.on_commit, args.commit_watch_interval_s).start()
    try:  # the scheduled runs that came due while no agent served them: one catch-up below does it
        forget_missed_runs(f"{node_housekeeping.name}/{deployment_name(host)}", interval)
    except Exception as exc:  # noqa: BLE001 - late runs skip themselves anyway
        log.warning("node %s: missed housekeeping runs not deleted: %s", host, exc)
    if args.catch_up:
        # Whatever this node missed while no agent ran (events fire only for the listening): first.
        try:
            node_housekeeping(str(config), host)
        except Exception as exc:  # noqa: BLE001 - the agent must start serving anyway
            log.error("node %s: the start-up housekeeping failed: %s", host, exc)
    try:
        serve(
            *node_deployments(
                str(config), host, interval, replicate=replicate, on_staged_event=args.on_commit == "event"
            ),
            limit=args.limit,
            query_seconds=args.poll_interval_s,
        )
    finally:
        if watcher is not None:
            watcher.stop()
        if part_runs is not None:
            part_runs.close(wait=False)
        if peer_server is not None:
            withdraw(peer_server.store.hot_root)
            peer_server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
