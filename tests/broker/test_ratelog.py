"""broker.protocol.ratelog: a line an interval, and what a burst held back said within the
next interval even when no other line comes (the metrics hunt: two of four worker deaths at
once were in no line at all, the count waiting for a next line that never came)."""
from __future__ import annotations

import logging

from broker.protocol import ratelog
from broker.protocol.ratelog import RateLimitedLog


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_burst_is_one_line_then_its_tail_within_the_next_interval(monkeypatch, caplog):
    clock = Clock()
    monkeypatch.setattr(ratelog.time, "monotonic", clock)
    log = RateLimitedLog(logging.getLogger("test-ratelog"), every=1.0)
    with caplog.at_level(logging.WARNING, logger="test-ratelog"):
        for pid in (11, 12, 13, 14, 15):
            log.warning("worker pid=%d died", pid)
        assert [r.getMessage() for r in caplog.records] == ["worker pid=11 died"]
        log.flush()  # the interval is not over: nothing yet
        assert len(caplog.records) == 1
        clock.t += 1.0
        log.flush()
        assert caplog.records[-1].getMessage() == (
            "4 similar messages held back in the last 1s: worker pid=12 died; worker pid=13 died; "
            "worker pid=14 died; and 1 more")
        clock.t += 5.0
        log.flush()  # said once
        assert len(caplog.records) == 2
        log.warning("worker pid=%d died", 16)  # a fresh line, no stale count
        assert caplog.records[-1].getMessage() == "worker pid=16 died"
        log.warning("worker pid=%d died", 17)
        log.warning("worker pid=%d died", 18)
        clock.t += 1.0
        log.warning("worker pid=%d died", 19)  # the next line carries the count, as before
        assert caplog.records[-1].getMessage() == "worker pid=19 died (2 similar messages suppressed)"
        clock.t += 5.0
        log.flush()
        assert len(caplog.records) == 4  # and the flush has nothing left to say


def test_a_line_about_a_request_keeps_its_rid_held_back_or_not(monkeypatch, caplog):
    # A throttled line naming a request (WORKER_FAILED at the broker): its rid is a field of
    # the line it writes, and part of the summary that says what a burst held back.
    clock = Clock()
    monkeypatch.setattr(ratelog.time, "monotonic", clock)
    log = RateLimitedLog(logging.getLogger("test-ratelog"), every=1.0)
    with caplog.at_level(logging.WARNING, logger="test-ratelog"):
        for i in (1, 2):
            log.warning("request failed: %s", "its workers died", extra={"rid": f"7:{i}", "code": 502})
        assert caplog.records[0].rid == "7:1" and caplog.records[0].code == 502
        clock.t += 1.0
        log.flush()
        assert caplog.records[-1].getMessage() == (
            "1 similar messages held back in the last 1s: request failed: its workers died rid=7:2")


def test_the_same_message_held_back_is_said_once_with_its_count(monkeypatch, caplog):
    # The tcp fuzz audit: one failed handshake's words, written three times in one line.
    clock = Clock()
    monkeypatch.setattr(ratelog.time, "monotonic", clock)
    log = RateLimitedLog(logging.getLogger("test-ratelog"), every=1.0)
    with caplog.at_level(logging.WARNING, logger="test-ratelog"):
        for _ in range(6):
            log.warning("a handshake on %s failed", "tcp://x:1")
        clock.t += 1.0
        log.flush()
        assert caplog.records[-1].getMessage() == (
            "5 similar messages held back in the last 1s: a handshake on tcp://x:1 failed (x5)")
