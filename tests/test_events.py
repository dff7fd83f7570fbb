"""The event log (``node.common.events``): a node holds only its newest records in memory, its file holds all."""

from __future__ import annotations

import threading

import pytest

from node.common.events import EventLog, read_events, record_time


def test_a_bounded_log_holds_the_newest_records_and_writes_every_one(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", keep=3)
    for i in range(5):
        log.emit("step", t0=float(i), t1=i + 0.5, learner="a", step=i)
    log.emit("merge", t=9.0, fragment=0)
    assert [r.get("step") for r in log.snapshot()] == [3, 4, None]
    assert log.emitted == 6 and log.trimmed == 3
    assert [r["kind"] for r in log.of("merge")] == ["merge"]
    log.close()
    assert [r.get("step") for r in read_events(tmp_path / "events.jsonl")] == [0, 1, 2, 3, 4, None]


def test_an_unbounded_log_keeps_everything():
    log = EventLog()
    for i in range(100):
        log.emit("x", t=float(i))
    assert len(log.records) == 100 and log.trimmed == 0


def test_keep_must_hold_at_least_one_record():
    with pytest.raises(ValueError, match="keep=0 is invalid"):
        EventLog(keep=0)


def test_snapshot_is_safe_while_other_threads_emit():
    log = EventLog(keep=1000)
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            log.emit("x", t=0.0)

    th = threading.Thread(target=writer)
    th.start()
    try:
        for _ in range(200):
            assert len(log.snapshot()) <= 1000  # a deque changed during iteration would raise here
    finally:
        stop.set()
        th.join()


def test_record_time_reads_a_point_or_the_start_of_a_span():
    assert record_time({"kind": "merge", "t": 4.5}) == 4.5
    assert record_time({"kind": "step", "t0": 2.0, "t1": 3.0}) == 2.0


def _train(log: EventLog, steps: int) -> None:
    """One learner, one fragment: each 1 s step contributed and merged at once."""
    for i in range(steps):
        log.emit("step", learner="a", step=i, t0=float(i), t1=i + 1.0)
        log.emit("contribute", learner="a", fragment=0, step=i, cid=f"c{i}", t=i + 1.0)
        log.emit("merge", fragment=0, round=i, cids=[f"c{i}"], t=i + 1.0)


def test_status_goodput_covers_the_records_held_and_says_since_when():
    from node.swarm.status import held_goodput

    whole = EventLog()
    _train(whole, 10)
    g, since = held_goodput(whole, 0.0, 20.0, "a", [1.0])
    assert since == 0.0 and g == pytest.approx(10 / 20)  # 10 useful seconds of 20 since the start

    held = EventLog(keep=12)  # the last 4 steps' records
    _train(held, 10)
    g, since = held_goodput(held, 0.0, 20.0, "a", [1.0])
    assert since == 6.0 and g == pytest.approx(4 / 14)  # 4 useful seconds of the 14 since the oldest held


def test_reading_skips_a_line_cut_by_a_kill_and_a_missing_file_is_empty(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(
        '{"kind":"step","t0":1}\n{"kind":"merge","t"\n{"kind":"join","t":3}\n'
    )  # cut, then appended
    assert [r["kind"] for r in read_events(path)] == ["step", "join"]
    assert read_events(tmp_path / "none.jsonl") == []
