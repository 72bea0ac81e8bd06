"""The agent sees its node's parts committed on its own disk and starts their runs itself
(agent/commit_watch.py, agent/part_runs.py): what counts as a commit, what is reported once, and the
runs it starts, in order and bounded."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from ckptflow.agent.commit_watch import CommitWatcher
from ckptflow.agent.part_runs import PartRuns
from ckptflow.storage.manifest import MANIFEST_NAME


def _commit(hot: Path, run: str, step: int) -> Path:
    """A part as the node's leader leaves it: files first, the manifest last (by rename)."""
    directory = hot / run / f"step-{step}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "__0_0.distcp").write_bytes(b"x" * 16)
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text("{}")
    os.replace(tmp, directory / MANIFEST_NAME)
    return directory


def test_only_new_commits_are_reported_oldest_first_and_each_once(tmp_path: Path) -> None:
    _commit(tmp_path, "llm", 10)  # held before the agent started: start-up catch-up's, not reported
    seen: list[tuple[str, int]] = []
    watcher = CommitWatcher(tmp_path, lambda run, step: seen.append((run, step)))
    watcher.poll(report=False)
    (tmp_path / "llm" / "step-20").mkdir()  # a part without its decision yet: not committed
    (tmp_path / "llm" / "step-30.partial-abc").mkdir()  # being written
    (tmp_path / "llm" / "quarantine").mkdir()
    (tmp_path / ".ckptflow-peer.json").write_text("{}")
    assert watcher.poll() == []
    _commit(tmp_path, "llm", 20)
    _commit(tmp_path, "llm", 15)
    _commit(tmp_path, "other", 5)
    assert watcher.poll() == [("other", 5), ("llm", 15), ("llm", 20)]
    assert watcher.poll() == []
    assert seen == [("other", 5), ("llm", 15), ("llm", 20)]


def test_a_step_saved_again_after_being_moved_aside_counts_as_a_new_commit(tmp_path: Path) -> None:
    _commit(tmp_path, "llm", 10)
    watcher = CommitWatcher(tmp_path, lambda run, step: None)
    watcher.poll(report=False)
    (tmp_path / "llm" / "step-10").rename(tmp_path / "llm" / "stale-10")  # superseded: moved aside
    assert watcher.poll() == []
    _commit(tmp_path, "llm", 10)  # the step saved again: another manifest file
    assert watcher.poll() == [("llm", 10)]


def test_an_unreadable_hot_root_reports_nothing_twice_once_it_is_back(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    _commit(hot, "llm", 10)
    watcher = CommitWatcher(hot, lambda run, step: None)
    watcher.poll(report=False)
    hot.rename(tmp_path / "away")  # the disk is gone for a while (unmounted, EIO)
    assert watcher.poll() == []
    (tmp_path / "away").rename(hot)
    assert watcher.poll() == []  # step 10 was known: not a new commit


def test_a_handler_that_fails_does_not_hide_the_next_commit(tmp_path: Path) -> None:
    seen: list[int] = []

    def handler(run: str, step: int) -> None:
        seen.append(step)
        if step == 1:
            raise RuntimeError("catalog down")

    watcher = CommitWatcher(tmp_path, handler)
    watcher.poll(report=False)
    _commit(tmp_path, "llm", 1)
    _commit(tmp_path, "llm", 2)
    assert watcher.poll() == [("llm", 1), ("llm", 2)]
    assert seen == [1, 2]


def test_the_watcher_thread_reports_a_commit_within_a_few_polls(tmp_path: Path) -> None:
    arrived = threading.Event()
    watcher = CommitWatcher(tmp_path, lambda run, step: arrived.set(), interval_s=0.05).start()
    try:
        _commit(tmp_path, "llm", 7)
        assert arrived.wait(timeout=30)
    finally:
        watcher.stop()


def test_a_non_positive_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval must be > 0"):
        CommitWatcher(Path("."), lambda run, step: None, interval_s=0)


def test_each_commit_starts_every_part_flow_of_the_node_with_its_parameters() -> None:
    calls: list[tuple[str, dict]] = []

    def flow(name: str):
        def call(**kwargs: object) -> str:
            calls.append((name, kwargs))
            return name

        return call

    runs = PartRuns(
        "/etc/ckptflow.yaml",
        "node7",
        replicate=True,
        limit=2,
        flows={"promote-part": flow("p"), "replicate-part": flow("r")},
    )
    futures = runs.on_commit("llm", 40)
    assert sorted(f.result(timeout=30) for f in futures) == ["p", "r"]
    runs.close()
    assert sorted(c[0] for c in calls) == ["p", "r"]
    assert all(
        c[1] == {"run": "llm", "step": 40, "config_path": "/etc/ckptflow.yaml", "node": "node7"}
        for c in calls
    )


def test_each_flow_has_its_own_lane_a_waiting_replication_is_dropped_promotions_all_run() -> None:
    gate = threading.Event()
    done: list[tuple[str, int]] = []
    replicating = threading.Event()

    def promote(**kw: object) -> None:
        gate.wait(10)
        done.append(("promote", kw["step"]))  # type: ignore[arg-type]

    def replicate(**kw: object) -> None:
        if kw["step"] == 1:
            replicating.set()
            gate.wait(10)
        done.append(("replicate", kw["step"]))  # type: ignore[arg-type]

    runs = PartRuns(
        "c.yaml", "n", replicate=True, limit=2, flows={"promote-part": promote, "replicate-part": replicate}
    )
    first = runs.on_commit("llm", 1)  # promote 1 holds the promote lane, replicate 1 its own lane
    assert replicating.wait(10)  # the push did not wait behind the blocked promotion
    second = runs.on_commit("llm", 2)  # both wait behind step 1's runs
    third = runs.on_commit("llm", 3)
    gate.set()
    for f in [*first, *second, *third]:
        f.result(timeout=30)
    runs.close()
    # Replication of step 2 was still waiting when step 3 was committed: dropped. Every promotion ran.
    assert [d for d in done if d[0] == "replicate"] == [("replicate", 1), ("replicate", 3)]
    assert [d for d in done if d[0] == "promote"] == [("promote", 1), ("promote", 2), ("promote", 3)]
    assert [(d[0], d[2], d[3]) for d in runs.dropped] == [("replicate-part", 2, 3)]


def test_after_a_restore_from_an_older_step_the_lower_steps_committed_next_are_the_newest() -> None:
    gate = threading.Event()
    done: list[int] = []

    def replicate(**kw: object) -> None:
        gate.wait(10)
        done.append(kw["step"])  # type: ignore[arg-type]

    runs = PartRuns("c.yaml", "n", replicate=True, limit=1, flows={"replicate-part": replicate})
    held = runs.on_commit("llm", 50)  # running; then the node is lost and the job resumes from 40
    waiting = runs.on_commit("llm", 45)
    gate.set()
    for f in [*held, *waiting]:
        f.result(timeout=30)
    runs.close()
    assert done == [50, 45] and list(runs.dropped) == []  # 45 is not "older" than 50: it came after


def test_a_failed_flow_is_logged_and_kept_and_the_next_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    def failing(**kw: object) -> None:
        raise RuntimeError("warm is read-only")

    runs = PartRuns("c.yaml", "n", replicate=False, limit=1, flows={"promote-part": failing})
    for step in (1, 2):
        (future,) = runs.on_commit("llm", step)
        assert future.result(timeout=30) is None
    runs.close()
    assert [(f[0], f[2]) for f in runs.failures] == [("promote-part", 1), ("promote-part", 2)]
    assert "warm is read-only" in caplog.text
    assert [s[2] for s in runs.started] == [1, 2]
    assert all(s[3] <= time.monotonic() for s in runs.started)


def test_the_push_starts_at_the_commit_and_its_flow_run_takes_the_result() -> None:
    from ckptflow.pipeline import ahead

    times: dict[str, float] = {}

    def push(config_path: str, run: str, step: int, host: str) -> list[str]:
        times["push"] = time.monotonic()
        return [f"{run}/{step} from {host}"]

    def flow(**kw: object) -> list[str]:
        time.sleep(0.5)  # the flow run's bookkeeping on a busy Prefect server
        times["flow"] = time.monotonic()
        taken = ahead.take(("replicate-part", kw["run"], kw["step"], kw["node"]))  # type: ignore[arg-type]
        assert taken is not None
        return taken.result()

    runs = PartRuns(
        "c.yaml", "n", replicate=True, flows={"replicate-part": flow}, ahead_work={"replicate-part": push}
    )
    (future,) = runs.on_commit("llm", 7)
    assert future.result(timeout=30) == ["llm/7 from n"]
    runs.close()
    assert times["push"] < times["flow"] - 0.3  # the push did not wait for the bookkeeping
    assert list(runs.failures) == []


def test_work_started_ahead_that_no_flow_run_took_still_ran_and_its_failure_is_reported() -> None:
    pushed: list[int] = []

    def push(config_path: str, run: str, step: int, host: str) -> None:
        pushed.append(step)
        if step == 2:
            raise OSError("peer disk full")

    def flow(**kw: object) -> None:
        raise ConnectionError("Prefect server unreachable")  # the flow run could not be created

    runs = PartRuns(
        "c.yaml", "n", replicate=True, flows={"replicate-part": flow}, ahead_work={"replicate-part": push}
    )
    for step in (1, 2):
        (future,) = runs.on_commit("llm", step)
        future.result(timeout=30)
    runs.close()
    assert pushed == [1, 2]
    failures = [(f[2], type(f[3]).__name__) for f in runs.failures]
    assert failures == [(1, "ConnectionError"), (2, "ConnectionError"), (2, "OSError")]


def test_the_work_of_each_commit_starts_at_the_commit_not_when_its_flow_runs_lane_is_free() -> None:
    """A flow run held up by Prefect's bookkeeping (its lane busy) does not hold up the next commit's
    copy: the work is submitted at the commit to its own pool."""
    from ckptflow.pipeline import ahead

    gate = threading.Event()
    worked: list[int] = []

    def copy(config_path: str, run: str, step: int, host: str) -> int:
        worked.append(step)
        return step

    def flow(**kw: object) -> int:
        gate.wait(10)  # step 1's run: a busy Prefect server
        taken = ahead.take(("promote-part", kw["run"], kw["step"], kw["node"]))  # type: ignore[arg-type]
        assert taken is not None
        return taken.result()

    runs = PartRuns("c.yaml", "n", replicate=False, limit=1, flows={"promote-part": flow},
                    ahead_work={"promote-part": copy})  # fmt: skip
    first = runs.on_commit("llm", 1)
    second = runs.on_commit("llm", 2)  # its lane waits behind step 1's run
    deadline = time.monotonic() + 10
    while worked != [1, 2] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worked == [1, 2]  # both copies ran while step 1's flow run still waited
    gate.set()
    assert [f.result(timeout=30) for f in [*first, *second]] == [1, 2]
    runs.close()
    assert [w[2] for w in runs.work_started] == [1, 2] and list(runs.failures) == []


def test_a_replication_whose_work_has_not_begun_is_dropped_with_its_flow_run_at_the_next_commit() -> None:
    from ckptflow.pipeline import ahead

    gate = threading.Event()
    pushing = threading.Event()
    pushed: list[int] = []
    recorded: list[int] = []

    def push(config_path: str, run: str, step: int, host: str) -> int:
        if step == 1:
            pushing.set()
            gate.wait(10)
        pushed.append(step)
        return step

    def flow(**kw: object) -> int:
        taken = ahead.take(("replicate-part", kw["run"], kw["step"], kw["node"]))  # type: ignore[arg-type]
        assert taken is not None
        recorded.append(taken.result())
        return recorded[-1]

    runs = PartRuns("c.yaml", "n", replicate=True, limit=1, flows={"replicate-part": flow},
                    ahead_work={"replicate-part": push})  # fmt: skip
    futures = runs.on_commit("llm", 1)
    assert pushing.wait(10)  # step 1's push is under way: it is never dropped
    futures += runs.on_commit("llm", 2)  # waits behind it...
    futures += runs.on_commit("llm", 3)  # ...and is dropped here
    gate.set()
    assert [f.result(timeout=30) for f in futures] == [1, None, 3]
    runs.close()
    assert pushed == [1, 3] and recorded == [1, 3]
    assert [(d[0], d[2], d[3]) for d in runs.dropped] == [("replicate-part", 2, 3)]
    assert ahead.take(("replicate-part", "llm", 2, "n")) is None  # nothing left registered
