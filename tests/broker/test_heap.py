"""broker.protocol.heap: the startup heap frozen out of the cyclic collector's reach, in our
own processes only.  Each check runs in a process of its own: freezing is for a whole
process, and the test runner's heap is not one of ours to freeze."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import gc, json, weakref
gc.disable()  # no automatic collection: only freeze_startup_heap's own can free the cycle
from broker.protocol.heap import freeze_startup_heap

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a          # a cycle: only the cyclic collector frees it
dead = weakref.ref(a)
del a, b
kept = [Node() for _ in range(100)]  # alive at startup: frozen
n = freeze_startup_heap()
print(json.dumps({"n": n, "count": gc.get_freeze_count(), "cycle_freed": dead() is None,
                  "kept_frozen": all(o is not kept[0] for o in gc.get_objects())}))
"""


def test_startup_garbage_is_collected_and_what_is_alive_is_frozen():
    p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["n"] == r["count"] > 100
    assert r["cycle_freed"]  # collected first, not frozen with the rest
    assert r["kept_frozen"]  # the live objects left the collector's generations


def test_the_client_sdk_never_freezes_its_host_applications_heap():
    """A library must not freeze the heap of the application that imports it."""
    for path in (ROOT / "client_sdk").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "freeze_startup_heap" not in names and "freeze" not in names, path
        assert "broker.protocol.heap" not in mods, path


def test_descriptors_closed_between_looks_add_up_to_a_trim():
    """`ClosesSeen` (a worker's housekeeping): each fall of the descriptor count between two
    looks counts, rises do not undo it, and a trim is due once `TRIM_AFTER_CLOSES` closed."""
    from broker.protocol.heap import TRIM_AFTER_CLOSES, ClosesSeen

    c = ClosesSeen()
    assert not c.look(2000)  # the first look: nothing to compare with
    assert not c.look(2000 - TRIM_AFTER_CLOSES // 2)
    assert not c.look(3000)  # a crowd came: nothing closed
    assert not c.look(-1)  # could not list: no change
    assert c.look(3000 - TRIM_AFTER_CLOSES // 2)
    assert c.look(3000 - TRIM_AFTER_CLOSES // 2)  # still due until trimmed
    c.trimmed()
    assert not c.look(3000 - TRIM_AFTER_CLOSES // 2 - 1)  # counted afresh after a trim


def test_connections_seen_to_end_count_where_no_fall_shows():
    """A crowd that came and left between two looks leaves the descriptor count where it was:
    the ends its caller saw count (`ClosesSeen.look`'s ``ended``), whichever is more of the
    two for the same interval (a fall and the ends it shows are the same closes)."""
    from broker.protocol.heap import TRIM_AFTER_CLOSES, ClosesSeen

    c = ClosesSeen()
    half = TRIM_AFTER_CLOSES // 2
    assert not c.look(1000)
    assert c.look(1000, TRIM_AFTER_CLOSES)  # no fall, every one of them ended
    c.trimmed()
    assert not c.look(1000 - half, half)  # one crowd, seen both ways: counted once
    assert not c.look(-1, 10)  # could not list: the ends still count
    assert c.look(1000 - 2 * half + 10)  # a fall from the last listing


def test_a_trim_without_a_thread_to_run_it_is_skipped_and_said(monkeypatch, caplog):
    """The resource audit: with the process's threads at a pids cgroup's limit, the trim's
    thread could not start, and the RuntimeError ended the broker's (and a worker's) loop.
    The trim is housekeeping: skipped, said once a minute at most."""
    import logging
    import threading

    from broker.protocol import heap

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    monkeypatch.setattr(heap, "_trim_refused_at", -1e9)
    with caplog.at_level(logging.WARNING, logger="broker.protocol.heap"):
        assert heap.start_trim() is None
        assert heap.start_trim() is None
    said = [r for r in caplog.records if "could not start a thread" in r.getMessage()]
    assert len(said) == 1 and "can't start new thread" in said[0].getMessage()


def test_a_burst_is_trimmed_once_it_is_over_and_not_during_it():
    from broker.protocol.heap import TRIM_AFTER_BYTES, TRIM_QUIET_S, BurstSeen

    b = BurstSeen()
    t = 1000.0
    assert not b.due(t)  # nothing moved
    b.moved += TRIM_AFTER_BYTES // 2
    assert not b.due(t + 1)  # moving, and too little yet
    b.moved += TRIM_AFTER_BYTES
    assert not b.due(t + 2)  # still moving
    assert not b.due(t + 3)  # quiet for a second only: bursts of a stream come seconds apart
    assert not b.due(t + 2 + TRIM_QUIET_S - 0.5)
    assert b.due(t + 2 + TRIM_QUIET_S)  # quiet long enough: the burst is over
    assert not b.due(t + 3 + TRIM_QUIET_S)  # once
    b.moved += TRIM_AFTER_BYTES - 1
    t = 2000.0  # long after: the quiet needed is the first one again
    assert not b.due(t) and not b.due(t + TRIM_QUIET_S)  # a small one after it: not worth a trim
    b.moved += 1
    assert b.due(t + TRIM_QUIET_S + 1)  # ... until its bytes add up (a trickle: the quiet goes on)


def test_a_stream_whose_bursts_come_back_soon_after_a_trim_is_trimmed_ever_more_rarely():
    # The trim audit: bursts every 2 s got a trim between each, and the next burst faulted
    # its pages in again (1.5x the broker's CPU a request).
    from broker.protocol.heap import TRIM_AFTER_BYTES, TRIM_BACKOFF_S, TRIM_QUIET_MAX_S, TRIM_QUIET_S, BurstSeen

    b = BurstSeen()
    t, trims, quiet = 0.0, [], []
    for _ in range(12):  # a burst, then a gap of 6 s (past the first quiet), again and again
        b.moved += TRIM_AFTER_BYTES
        for k in range(7):
            if b.due(t + k):
                trims.append(t + k)
        quiet.append(b.quiet_s)
        t += 7
    # One trim, after the first gap; the next burst came 1 s after it: 10 s of quiet needed
    # since, which no gap of this stream reaches.
    assert trims == [5.0] and quiet[-1] == 2 * TRIM_QUIET_S
    # A stream whose gaps pass each quiet needed: 5, 10, 20, 40, then 60 s at most.
    c = BurstSeen()
    t2, gaps = 0.0, []
    for _ in range(6):
        c.moved += TRIM_AFTER_BYTES
        assert not c.due(t2)
        gaps.append(c.quiet_s)
        assert c.due(t2 + c.quiet_s)
        t2 += c.quiet_s + 1
    assert gaps == [5.0, 10.0, 20.0, 40.0, TRIM_QUIET_MAX_S, TRIM_QUIET_MAX_S]
    # Then silence: trimmed after the quiet needed; frames long after start over at 5 s.
    last = t - 7  # the last burst's look
    assert not b.due(last + 2 * TRIM_QUIET_S - 0.5)
    assert b.due(last + 2 * TRIM_QUIET_S)
    t = last + 2 * TRIM_QUIET_S + TRIM_BACKOFF_S + 1
    b.moved += TRIM_AFTER_BYTES
    assert not b.due(t) and b.quiet_s == TRIM_QUIET_S and b.due(t + TRIM_QUIET_S)


def test_a_trickle_of_big_frames_does_not_keep_a_bursts_memory():
    # Found by review: one 64 KiB+ request every few seconds broke every quiet, and a
    # burst's memory stayed for good.
    from broker.protocol.heap import TRIM_AFTER_BYTES, TRIM_QUIET_S, TRIM_TRICKLE, BurstSeen

    b = BurstSeen()
    b.moved += 2 * TRIM_AFTER_BYTES
    assert not b.due(0.0)
    for k in range(1, int(TRIM_QUIET_S)):
        b.moved += TRIM_TRICKLE  # one ordinary large request a second
        assert not b.due(float(k))
    b.moved += TRIM_TRICKLE
    assert b.due(TRIM_QUIET_S)


def test_a_doubled_quiet_starts_over_after_a_long_rest():
    # Found by review: after it doubled, less than TRIM_AFTER_BYTES moved, no trim came, and
    # a burst hours later still needed the long quiet.
    from broker.protocol.heap import TRIM_AFTER_BYTES, TRIM_BACKOFF_S, TRIM_QUIET_S, BurstSeen

    b = BurstSeen()
    b.moved += TRIM_AFTER_BYTES
    assert not b.due(0.0) and b.due(TRIM_QUIET_S)
    b.moved += TRIM_AFTER_BYTES // 4  # soon after the trim: the quiet doubles
    assert not b.due(TRIM_QUIET_S + 1) and b.quiet_s == 2 * TRIM_QUIET_S
    assert not b.due(1000.0)  # too little for a trim
    b.moved += TRIM_AFTER_BYTES  # hours later
    assert not b.due(10_000.0) and b.quiet_s == TRIM_QUIET_S
    assert b.due(10_000.0 + TRIM_QUIET_S)
    assert TRIM_BACKOFF_S < 10_000.0
