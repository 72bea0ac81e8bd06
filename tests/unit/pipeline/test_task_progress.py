"""Tasks report bytes to the sink a CLI command set in this process, and to nobody otherwise."""

from __future__ import annotations

import threading

from ckptflow.pipeline import progress


def test_no_sink_means_no_callback_and_reports_are_dropped():
    assert progress.sink() is None
    progress.report(10)  # nobody listens: nothing happens


def test_reports_from_threads_reach_the_sink_while_inside_and_stop_after():
    got: list[int] = []
    lock = threading.Lock()

    def callback(n: int) -> None:
        with lock:
            got.append(n)

    with progress.reporting_to(callback):
        callback_seen_by_tasks = progress.sink()
        assert callback_seen_by_tasks is not None
        threads = [threading.Thread(target=lambda: [callback_seen_by_tasks(1) for _ in range(100)])]
        threads += [threading.Thread(target=lambda: [progress.report(2) for _ in range(100)])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sum(got) == 300 and progress.sink() is None
    progress.report(5)
    assert sum(got) == 300
