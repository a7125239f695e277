"""The engine's metrics recorder: counts and latency windows move together."""

import threading

from engine.metrics import MetricsRecorder


def test_a_finish_counts_and_measures_in_one_step():
    rec = MetricsRecorder()
    rec.finish("stop", 1.0)
    rec.finish("cancelled", 2.0)
    rec.finish("length", 3.0)
    rec.finish("cancelled", 4.0)
    pct = rec.percentiles()
    assert rec.finished == {"stop": 1, "cancelled": 2, "length": 1}
    assert pct["release_ms"].count == 4 and rec.release_latency_ms == 4.0
    # only cancels enter the cancel window: its samples equal the cancelled count
    assert pct["cancel_release_ms"].count == rec.finished["cancelled"]
    assert pct["cancel_release_ms"].p99 == 4.0


def test_finishes_from_many_threads_lose_nothing():
    rec = MetricsRecorder(window=100_000)

    def work():
        for i in range(2000):
            rec.finish("cancelled" if i % 2 else "stop", float(i))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.finished == {"cancelled": 4000, "stop": 4000}
    assert rec.percentiles()["cancel_release_ms"].count == 4000
