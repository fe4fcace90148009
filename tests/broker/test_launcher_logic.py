"""The launcher's decisions without processes: `broker.launcher.Supervisor` (events in, actions
out, time passed in), the deploy file's schema (`broker.config`), and the broker's drain
(`Scheduler.drain`)."""
from __future__ import annotations

import textwrap

import pytest

from broker import config as C
from broker.launcher import (
    AllReady, Backoff, Finished, GiveUp, KillWorker, Notice, RollDone, StartWorker, StopWorker, Supervisor, WorkerGone,
)


def starts(actions):
    return [a for a in actions if type(a) is StartWorker]


def only(actions, kind):
    return [a for a in actions if type(a) is kind]


def running(pools=(("a", 2), ("b", 1)), **kw):
    """A supervisor whose first workers are all READY at t=0; returns it and {slot: wid}."""
    s = Supervisor(list(pools), **kw)
    first = starts(s.start(0.0))
    assert [(a.pool, a.index) for a in first] == [(p, i) for p, n in pools for i in range(n)]
    out = []
    for a in first:
        out += s.worker_ready(a.wid, 0.0)
    assert out[-1] == AllReady(sum(n for _, n in pools)) and s.phase == "running"
    return s, {(a.pool, a.index): a.wid for a in first}


# ------------------------------------------------------------------------- start


def test_ready_only_when_every_slot_was_ready_once():
    s = Supervisor([("a", 2)])
    w0, w1 = starts(s.start(0.0))
    assert s.worker_ready(w0.wid, 1.0) == []
    assert s.worker_ready(w0.wid, 1.0) == []  # a second READY changes nothing
    assert s.worker_ready(w1.wid, 2.0) == [AllReady(2)]
    assert s.worker_ready(999, 2.0) == []  # unknown worker


def test_a_worker_that_dies_before_ready_at_start_gives_up_and_stops_the_rest():
    s = Supervisor([("a", 1), ("b", 1)])
    a, b = starts(s.start(0.0))
    out = s.worker_exited(a.wid, 2, 1.0)
    assert GiveUp("a", 0, a.wid, 2) in out and s.gave_up == GiveUp("a", 0, a.wid, 2)
    assert only(out, StopWorker) == [StopWorker(b.wid)]
    assert starts(out) == []
    out = s.worker_exited(b.wid, 0, 1.5)
    assert out[-1] == Finished() and s.finished


def test_a_crash_after_ready_during_start_is_restarted_not_given_up():
    s = Supervisor([("a", 2)], backoff=Backoff(0.5, 30, 60))
    w0, w1 = starts(s.start(0.0))
    s.worker_ready(w0.wid, 1.0)
    out = s.worker_exited(w0.wid, -9, 2.0)
    assert s.gave_up is None and only(out, WorkerGone)[0].restart_in == 0.5
    assert starts(s.tick(2.5))[0].index == 0
    assert s.worker_ready(w1.wid, 3.0) == [AllReady(2)]  # slot 0 was ready once already


# ------------------------------------------------------------------------- crashes and backoff


def test_crash_restart_backoff_doubles_caps_and_resets_after_a_long_uptime():
    s, wid = running(backoff=Backoff(0.5, 4.0, 60.0))
    cur, t, delays = wid[("a", 0)], 0.0, []
    for _ in range(6):
        t += 1.0
        out = s.worker_exited(cur, 1, t)
        gone = only(out, WorkerGone)[0]
        assert not gone.expected and gone.code == 1
        delays.append(gone.restart_in)
        assert starts(out) == [] and s.next_wakeup() == pytest.approx(t + gone.restart_in)
        assert starts(s.tick(t + gone.restart_in - 0.01)) == []  # not before the backoff
        t += gone.restart_in
        (new,) = starts(s.tick(t))
        assert (new.pool, new.index) == ("a", 0) and "exit code 1" in new.reason
        cur = new.wid
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    s.worker_ready(cur, t)
    # It served past reset_after: replaced at once (a pool short of it waits for nothing but
    # a start), and a crash in a row after that is a first crash again.
    t += 61.0
    out = s.worker_exited(cur, -11, t)
    assert only(out, WorkerGone)[0].restart_in == 0.0
    (new,) = starts(out)
    assert (new.pool, new.index) == ("a", 0) and "at once: it had served 61 s" in new.reason
    out = s.worker_exited(new.wid, 1, t + 1.0)
    assert only(out, WorkerGone)[0].restart_in == 0.5 and starts(out) == []
    assert len(s.workers()) == 2  # the other slots untouched (slot 0 waits its backoff)


def test_healthy_is_serving_after_ready_not_loading():
    # A model that loads for 70 s and crashes a second after its READY never served: its
    # crashes count up (the backoff grows), however long each run lived.
    s, wid = running(backoff=Backoff(0.5, 30.0, 60.0))
    cur, t, delays = wid[("a", 0)], 0.0, []
    for _ in range(4):
        t += 1.0
        gone = only(s.worker_exited(cur, 1, t), WorkerGone)[0]
        delays.append(gone.restart_in)
        t += gone.restart_in
        (new,) = starts(s.tick(t))
        cur = new.wid
        t += 70.0
        s.worker_ready(cur, t)
    assert delays == [0.5, 1.0, 2.0, 4.0]


def test_a_slot_that_served_long_enough_rolls_to_a_first_crash_again():
    # Quick crashes, then two hours of service, then a rolling restart to a bad deploy:
    # its first crash waits the first backoff, not the one the old crashes built up.
    s, wid = running(pools=(("a", 1),), backoff=Backoff(0.5, 30.0, 60.0))
    cur, t = wid[("a", 0)], 0.0
    for _ in range(6):
        t += 1.0
        gone = only(s.worker_exited(cur, 1, t), WorkerGone)[0]
        t += gone.restart_in
        (new,) = starts(s.tick(t))
        cur = new.wid
        s.worker_ready(cur, t)
    assert gone.restart_in == 16.0
    t += 7200.0
    (n,) = starts(s.roll(t))
    out = s.worker_exited(n.wid, 1, t + 7.0)  # the new code crashes before its READY
    assert only(out, WorkerGone)[0].restart_in == 0.5


def test_zero_backoff_restarts_at_once():
    s, wid = running(backoff=Backoff(0.0, 0.0, 60.0))
    out = s.worker_exited(wid[("b", 0)], -9, 5.0)
    assert [(a.pool, a.index) for a in starts(out)] == [("b", 0)]


def test_unknown_exit_is_ignored():
    s, _ = running()
    assert s.worker_exited(12345, 0, 1.0) == []


# ------------------------------------------------------------------------- rolling restart


def test_rolling_restart_replaces_one_worker_at_a_time_new_before_old():
    s, wid = running(pools=(("a", 2),))
    out = s.roll(10.0)
    (n0,) = starts(out)
    assert (n0.index, n0.reason) == (0, "rolling restart") and only(out, StopWorker) == []
    assert s.rolling
    out = s.worker_ready(n0.wid, 11.0)  # the replacement serves: the old one drains
    assert out == [StopWorker(wid[("a", 0)])]
    out = s.worker_exited(wid[("a", 0)], 0, 12.0)  # old gone: next slot
    assert only(out, WorkerGone)[0].expected
    (n1,) = starts(out)
    assert n1.index == 1
    assert s.worker_ready(n1.wid, 13.0) == [StopWorker(wid[("a", 1)])]
    out = s.worker_exited(wid[("a", 1)], 0, 14.0)
    assert out[-1] == RollDone("a") and not s.rolling
    assert sorted(w for _, _, w, _, _ in s.workers()) == [n0.wid, n1.wid]


def test_pools_roll_side_by_side():
    s, wid = running(pools=(("a", 1), ("b", 1)))
    assert [(a.pool, a.index) for a in starts(s.roll(1.0))] == [("a", 0), ("b", 0)]


def test_a_replacement_that_crashes_is_retried_and_the_old_worker_keeps_serving():
    s, wid = running(pools=(("a", 1),), backoff=Backoff(0.5, 30, 60))
    (n,) = starts(s.roll(1.0))
    out = s.worker_exited(n.wid, 1, 2.0)
    assert only(out, StopWorker) == [] and only(out, WorkerGone)[0].restart_in == 0.5
    (n2,) = starts(s.tick(2.5))
    assert s.worker_ready(n2.wid, 3.0) == [StopWorker(wid[("a", 0)])]
    assert s.worker_exited(wid[("a", 0)], 0, 4.0)[-1] == RollDone("a")


def test_a_replacement_never_ready_is_killed_as_hung_and_retried():
    # A model load that never ends (a hung device init) would hold the roll for good, and
    # every later SIGHUP with it: past ready_timeout it is SIGKILLed, a crash like any other.
    s, wid = running(pools=(("a", 1),), backoff=Backoff(0.5, 30, 60), ready_timeout=100.0)
    (n,) = starts(s.roll(1.0))
    assert s.next_wakeup() == pytest.approx(101.0)
    assert only(s.tick(100.9), KillWorker) == []
    out = s.tick(101.0)
    assert only(out, KillWorker) == [KillWorker(n.wid)] and "not READY" in out[0].message
    assert s.tick(102.0) == []  # once
    assert s.worker_ready(n.wid, 101.05) == []  # a READY read after the SIGKILL went out: it is dying
    out = s.worker_exited(n.wid, -9, 101.1)
    assert only(out, StopWorker) == [] and only(out, WorkerGone)[0].restart_in == 0.5  # the old one serves on
    (n2,) = starts(s.tick(101.6))
    assert s.worker_ready(n2.wid, 110.0) == [StopWorker(wid[("a", 0)])]
    assert s.worker_exited(wid[("a", 0)], 0, 111.0)[-1] == RollDone("a")


def test_a_worker_never_ready_at_start_is_killed_and_the_launch_gives_up():
    s = Supervisor([("a", 1)], ready_timeout=30.0)
    (a,) = starts(s.start(0.0))
    assert only(s.tick(30.0), KillWorker) == [KillWorker(a.wid)]
    out = s.worker_exited(a.wid, -9, 30.1)
    assert only(out, GiveUp) and s.phase == "stopped"  # nothing else was running


def test_a_ready_worker_the_broker_no_longer_lists_is_killed_as_hung_and_restarted():
    # SIGSTOPped, frozen, or wedged with the GIL held: the broker dropped it, but only its
    # exit would give the slot a new worker.  Absent from the broker's lists for hang_timeout.
    s, wid = running(pools=(("a", 2),), backoff=Backoff(0.5, 30, 60), hang_timeout=10.0)
    a0, a1 = wid[("a", 0)], wid[("a", 1)]
    assert s.watching
    assert s.broker_sees({a0, a1}, 5.0) == []
    assert s.broker_sees({a1}, 6.0) == []  # first missing from a list at 6
    assert s.broker_sees({a1}, 15.9) == []
    out = s.broker_sees({a1}, 16.0)
    assert only(out, KillWorker) == [KillWorker(a0)] and "not registered with the broker for 10 s" in out[0].message
    assert s.broker_sees({a1}, 30.0) == []  # once
    out = s.worker_exited(a0, -9, 16.1)
    assert only(out, WorkerGone)[0].restart_in == 0.5  # a crash like any other (it served 16 s < 60)
    (n,) = starts(s.tick(16.6))
    assert s.broker_sees({a1}, 17.0) == []  # not READY yet: ready_timeout's business
    s.worker_ready(n.wid, 17.5)
    assert s.broker_sees({a1}, 17.2) == []  # a list made before its READY does not count
    assert s.broker_sees({a1}, 18.0) == [] and s.broker_sees({a1}, 27.9) == []
    assert only(s.broker_sees({a1}, 28.0), KillWorker) == [KillWorker(n.wid)]


def test_only_the_brokers_own_clock_counts_and_listing_again_resets_it():
    s, wid = running(pools=(("a", 1),), hang_timeout=10.0)
    a0 = wid[("a", 0)]
    # A broker loop that stalls makes no new list: the same list, read again, never
    # reaches the timeout, however late it is read.
    assert s.broker_sees(set(), 9.0) == [] and s.broker_sees(set(), 9.0) == []
    assert s.broker_sees({a0}, 9.5) == []  # back (a reconnect after broker silence)
    assert s.broker_sees(set(), 19.4) == []  # the first list after a 10 s stall lacks it...
    assert s.broker_sees({a0}, 20.4) == []  # ...its heartbeat read after it: listed again
    assert s.broker_sees(set(), 21.0) == [] and s.broker_sees(set(), 30.9) == []
    assert only(s.broker_sees(set(), 31.0), KillWorker) == [KillWorker(a0)]


def test_a_worker_that_says_goodbye_on_its_own_is_stopping_and_its_successor_starts():
    # An operator's SIGTERM: the worker drains, says DISCONNECT and then waits for its
    # outputs' release (its drain grace), not registered: leaving, not hung.
    s, wid = running(pools=(("a", 2),), hang_timeout=10.0, stop_timeout=40.0)
    a0, a1 = wid[("a", 0)], wid[("a", 1)]
    out = s.broker_sees({a1}, 5.0, {a0: 4.5})
    assert "leaving on its own" in out[0].message and only(out, StopWorker) == []  # no signal of ours
    (n,) = starts(out)
    assert (n.pool, n.index) == ("a", 0)
    assert s.broker_sees({a1}, 30.0, {a0: 4.5}) == []  # not hung: stopping
    out = s.worker_exited(a0, 0, 31.0)
    assert only(out, WorkerGone)[0].expected and starts(out) == []
    # Past stop_timeout it is SIGKILLed, as any worker told to stop.
    s, wid = running(pools=(("a", 1),), stop_timeout=40.0)
    s.broker_sees(set(), 5.0, {wid[("a", 0)]: 4.0})
    assert only(s.tick(45.0), KillWorker) == [KillWorker(wid[("a", 0)])]
    # A goodbye said before its READY is another process's (its pid reused): not this one's.
    s, wid = running(pools=(("a", 1),), hang_timeout=10.0)
    assert s.broker_sees({wid[("a", 0)]}, 5.0, {wid[("a", 0)]: -1.0}) == []


def test_a_worker_that_exits_0_unasked_after_serving_left_on_its_own():
    # An operator's SIGTERM to an idle worker: it drains and exits 0 before the broker's
    # list says it said goodbye.  Not a crash: its successor now, the crash count unchanged.
    s, wid = running(pools=(("a", 1),), backoff=Backoff(0.5, 30, 60))
    out = s.worker_exited(wid[("a", 0)], 0, 5.0)
    [gone] = only(out, WorkerGone)
    assert gone.expected and gone.restart_in == 0.0 and "left on its own" in out[0].message
    (n,) = starts(out)
    assert n.reason == "its worker left on its own (exit 0)"
    s.worker_ready(n.wid, 6.0)
    # One that exits 0 at once after its READY, again and again, is a crash loop: backoff.
    out = s.worker_exited(n.wid, 0, 6.2)
    assert only(out, WorkerGone)[0].restart_in == 0.5 and starts(out) == []


def test_stopping_workers_and_a_zero_timeout_are_not_killed_as_hung():
    s, wid = running(pools=(("a", 1),), hang_timeout=0)
    assert s.broker_sees(set(), 1.0) == [] and s.broker_sees(set(), 1e9) == []
    s, wid = running(pools=(("a", 1),), hang_timeout=10.0, stop_timeout=100.0)
    (n,) = starts(s.roll(1.0))
    s.worker_ready(n.wid, 2.0)  # the old one is told to stop: it leaves the broker first
    assert s.broker_sees({n.wid}, 3.0) == [] and s.broker_sees({n.wid}, 50.0) == []
    s.worker_exited(wid[("a", 0)], 0, 51.0)
    s.shutdown(52.0)
    s.broker_idle(53.0)  # stopping: stop_timeout's business
    assert not s.watching and s.broker_sees(set(), 100.0) == []


def test_the_old_worker_crashing_mid_roll_needs_no_restart_of_its_own():
    s, wid = running(pools=(("a", 1),))
    (n,) = starts(s.roll(1.0))
    out = s.worker_exited(wid[("a", 0)], -9, 1.5)
    assert starts(out) == [] and only(out, WorkerGone)[0].restart_in is None
    assert s.worker_ready(n.wid, 2.0)[-1] == RollDone("a")


def test_a_sighup_while_starting_rolls_once_every_pool_is_ready():
    # The workers READY before the SIGHUP may have loaded the files it is about.
    s = Supervisor([("a", 1), ("b", 1)])
    a, b = starts(s.start(0.0))
    s.worker_ready(a.wid, 1.0)
    out = s.roll(1.5)
    assert starts(out) == [] and all("queued (the launcher is starting" in n.message for n in out)
    assert "queued already" in s.roll(1.6)[0].message
    out = s.worker_ready(b.wid, 2.0)
    assert out[0] == AllReady(2)
    assert [(n.pool, n.index, n.reason) for n in starts(out)] == [("a", 0, "rolling restart"),
                                                                  ("b", 0, "rolling restart")]


def test_a_sighup_during_a_roll_rolls_the_pool_again_after_it_once():
    # A deploy that changed the files twice: the workers replaced before the second SIGHUP
    # run the first change.  Queued, not dropped; two more SIGHUPs meanwhile are one roll.
    s, wid = running(pools=(("a", 2),))
    (n0,) = starts(s.roll(10.0))
    out = s.roll(10.5)
    assert starts(out) == [] and "queued (a rolling restart is under way" in out[0].message
    assert "queued already" in s.roll(10.6)[0].message
    s.worker_ready(n0.wid, 11.0)
    (n1,) = starts(s.worker_exited(wid[("a", 0)], 0, 12.0))
    s.worker_ready(n1.wid, 13.0)
    out = s.worker_exited(wid[("a", 1)], 0, 14.0)
    assert RollDone("a") in out and s.rolling  # and the queued one begins at once
    (m0,) = starts(out)
    assert (m0.index, m0.reason) == (0, "rolling restart")
    assert s.worker_ready(m0.wid, 15.0) == [StopWorker(n0.wid)]
    (m1,) = starts(s.worker_exited(n0.wid, 0, 16.0))
    s.worker_ready(m1.wid, 17.0)
    out = s.worker_exited(n1.wid, 0, 18.0)
    assert out[-1] == RollDone("a") and not s.rolling and starts(out) == []  # once


def test_roll_is_refused_while_shutting_down_and_a_queued_one_is_dropped():
    s, wid = running(pools=(("a", 1),))
    starts(s.roll(1.0))
    s.roll(1.5)  # queued
    s.shutdown(2.0)
    assert s.roll(2.5)[0].message.endswith("draining")
    assert not s.rolling and s._queued == []


# ------------------------------------------------------------------------- shutdown


def test_shutdown_drains_then_stops_every_worker_then_finishes():
    s, wid = running(stop_timeout=5.0, drain_timeout=30.0)
    out = s.shutdown(1.0)
    assert s.phase == "draining" and only(out, StopWorker) == []
    # A crash while draining is still restarted: admitted requests need workers.
    out = s.worker_exited(wid[("a", 1)], -9, 1.2)
    assert only(out, WorkerGone)[0].restart_in is not None
    assert s.roll(1.3)[0].message.endswith("draining")
    out = s.broker_idle(2.0)
    assert sorted(a.wid for a in only(out, StopWorker)) == sorted([wid[("a", 0)], wid[("b", 0)]])
    assert s.phase == "stopping"
    assert starts(s.tick(2.5)) == []  # no restart while stopping (the crashed slot's included)
    out = []
    for w in (wid[("a", 0)], wid[("b", 0)]):
        out += s.worker_exited(w, 0, 3.0)
    assert out[-1] == Finished() and s.finished and s.next_wakeup() is None


def test_a_worker_that_leaves_on_its_own_while_draining_is_not_replaced():
    # A stop of the whole service (systemd's KillMode=control-group) signals every worker with
    # the launcher: one that drained and exited 0, or said goodbye, while the broker still
    # finished admitted requests got a successor, which started (memory, a GPU's, beside the
    # workers still running requests) only to be stopped.
    s, wid = running(pools=(("a", 2),), stop_timeout=5.0)
    s.shutdown(1.0)
    out = s.worker_exited(wid[("a", 0)], 0, 2.0)
    assert starts(out) == [] and only(out, WorkerGone)[0].expected, out
    assert "not replaced" in only(out, Notice)[0].message
    out = s.broker_sees(set(), 2.5, {wid[("a", 1)]: 2.2})  # the other said goodbye
    assert starts(out) == [] and only(out, StopWorker) == [], out
    assert starts(s.tick(3.0)) == []
    out = s.broker_idle(3.0) + s.worker_exited(wid[("a", 1)], 0, 3.1)
    assert only(out, StopWorker) == [] and out[-1] == Finished(), out
    # Outside a shutdown it is replaced, as before (test_a_worker_that_exits_0_unasked_...).
    s, wid = running(pools=(("a", 1),))
    assert starts(s.worker_exited(wid[("a", 0)], 0, 5.0))


def test_drain_timeout_then_sigkill_after_stop_timeout():
    s, wid = running(pools=(("a", 1),), stop_timeout=5.0, drain_timeout=2.0)
    s.shutdown(1.0)
    assert s.next_wakeup() == 3.0
    out = s.tick(3.0)
    assert only(out, StopWorker) == [StopWorker(wid[("a", 0)])]
    assert s.next_wakeup() == 8.0
    assert only(s.tick(7.9), KillWorker) == []
    assert only(s.tick(8.0), KillWorker) == [KillWorker(wid[("a", 0)])]
    assert only(s.tick(9.0), KillWorker) == []  # once
    assert s.worker_exited(wid[("a", 0)], -9, 9.5)[-1] == Finished()


def test_second_signal_stops_at_once_and_a_third_repeats_the_sigterm():
    s, wid = running(pools=(("a", 1),))
    s.shutdown(1.0)
    assert only(s.shutdown(1.1), StopWorker) == [StopWorker(wid[("a", 0)])]
    assert only(s.shutdown(1.2), StopWorker) == [StopWorker(wid[("a", 0)])]


def test_shutdown_before_start_finishes_at_once():
    s = Supervisor([("a", 1)])
    assert s.shutdown(0.0) == [Finished()]


# ------------------------------------------------------------------------- the deploy file


def write(tmp_path, text):
    p = tmp_path / "deploy.toml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_pool_tables_parse_and_map_to_worker_flags(tmp_path):
    path = write(tmp_path, """
        [launcher]
        drain_timeout_s = 5
        hang_timeout_s = 0
        [[pool]]
        model = "echo"
        count = 2
        [[pool]]
        name = "fast"
        model = "pkg.mod:factory"
        device = "CPU"
        service = "svc"
        max_batch = 4
        max_delay_ms = 1
        max_cost = 2.5
        credit = 3
        transports = ["inline", "shm"]
        keep_warm_ms = 0
        drain_grace_s = 2
        lifo_after_ms = -1
        extra_args = ["--no-warmup"]
    """)
    d = C.load_launcher(path)
    assert [p.name for p in d.pools] == ["echo", "fast"] and d.workers == 3
    assert d.drain_timeout_s == 5.0 and d.stop_timeout == 40.0  # the echo pool's default grace (30) + 10
    assert d.hang_timeout_s == 0 and d.ready_timeout_s == 600.0
    args = d.pools[1].worker_args("ipc:///b", heartbeat_interval=0.2, heartbeat_liveness=3, link=("--insecure",))
    # One word a flag (a value starting with "-", as -1.0 here, was taken for a flag as two).
    assert args == ["--broker=ipc:///b", "--model=pkg.mod:factory", "--heartbeat-interval=0.2",
                    "--heartbeat-liveness=3", "--service=svc", "--device=cpu", "--max-batch=4",
                    "--max-delay-ms=1.0", "--max-cost=2.5", "--credit=3", "--transports=inline,shm",
                    "--keep-warm-ms=0.0", "--drain-grace-s=2.0", "--lifo-after-ms=-1.0", "--insecure",
                    "--no-warmup"]
    assert d.pools[0].worker_args("ipc:///b") == ["--broker=ipc:///b", "--model=echo"]
    from gpu_worker.__main__ import build_parser

    parsed = build_parser().parse_args(args)
    assert (parsed.lifo_after_ms, parsed.model, parsed.service) == (-1.0, "pkg.mod:factory", "svc")
    # What argparse takes for a flag as a word of its own: the worker exited 2 ("expected
    # one argument") for each (the operations-docs audit).
    pool, = C.load_launcher(write(tmp_path, """
        [[pool]]
        model = "echo"
        service = "-fast"
        lifo_after_ms = -1e20
    """)).pools
    parsed = build_parser().parse_args(pool.worker_args("ipc:///b"))
    assert (parsed.service, parsed.lifo_after_ms) == ("-fast", -1e20)
    # The broker's part of the same file is accepted as it is.
    from broker.server import BrokerConfig

    BrokerConfig.from_toml(path)


def test_a_file_without_pools_is_no_launcher(tmp_path):
    assert C.load_launcher(write(tmp_path, 'frontend = "ipc:///tmp/x"\n')) is None


@pytest.mark.parametrize("text, words", [
    ("[[pool]]\nmodel = 'echo'\ncuont = 2\n", ["[[pool]] #1: ", "'cuont'", "count"]),
    ("[[pool]]\nname = 'p'\nmodel = 'echo'\ncount = 0\n", ["[[pool]] #1 (name 'p')", "count must be an integer from 1 to 1024"]),
    ("[[pool]]\nmodel = 'echo'\ncount = 'two'\n", ["count must be"]),
    ("[[pool]]\nmodel = 'echo'\ncount = true\n", ["count must be"]),
    ("[[pool]]\ncount = 1\n", ["model is missing"]),
    ("[[pool]]\nmodel = 'mod:'\n", ["model must be"]),
    ("[[pool]]\nmodel = 'echo'\ndevice = 'gpu'\n", ["device must be"]),
    ("[[pool]]\nmodel = 'echo'\ntransports = ['tcp']\n", ["transports must be"]),
    ("[[pool]]\nmodel = 'echo'\nmax_delay_ms = -1\n", ["max_delay_ms must be a number from 0 to 1e+09"]),
    # the worker's own bound, checked with the file (the worker exited 2 after the broker bound)
    ("[[pool]]\nmodel = 'echo'\nkeep_warm_ms = 0.5\n", ["keep_warm_ms must be 0 (off), or a number of ms from 1"]),
    ("[[pool]]\nmodel = 'echo'\nkeep_warm_ms = 1e8\n", ["keep_warm_ms must be"]),
    ("[[pool]]\nmodel = 'echo'\nlifo_after_ms = 1e8\n", ["lifo_after_ms must be a number of ms up to 86400000"]),
    ("[[pool]]\nmodel = 'echo'\nlifo_after_ms = 'never'\n", ["lifo_after_ms must be"]),
    ("[[pool]]\nmodel = 'echo'\nlifo_after_ms = 50\nextra_args = ['--lifo-after-ms', '10']\n",
     ["extra_args may not set --lifo-after-ms", "lifo_after_ms key sets it already"]),
    ("[[pool]]\nmodel = 'echo'\nextra_args = '--x'\n", ["extra_args must be a list of strings"]),
    # What the launcher sets from the broker, or a key of the same table sets: a worker sent
    # to another broker, or with other heartbeats, was never seen registered (killed as hung).
    ("[[pool]]\nmodel = 'echo'\nextra_args = ['--broker', 'ipc:///x']\n",
     ["extra_args may not set --broker ('--broker')", "this broker's backend"]),
    ("[[pool]]\nmodel = 'echo'\nextra_args = ['--heartbeat-interval=5']\n",
     ["extra_args may not set --heartbeat-interval ('--heartbeat-interval=5')", "[scheduler] heartbeat_interval"]),
    ("[[pool]]\nmodel = 'echo'\nextra_args = ['--model', 'convnet']\n", ["may not set --model", "model key"]),
    ("[[pool]]\nmodel = 'echo'\nmax_batch = 2\nextra_args = ['--max-batch', '4']\n",
     ["may not set --max-batch ('--max-batch')", "the table's max_batch key sets it already"]),
    ("[[pool]]\nmodel = 'echo'\n[[pool]]\nmodel = 'echo'\n", ["[[pool]] #2", "name 'echo' is taken by [[pool]] #1"]),
    ("pool = 3\n", ["pool must be an array of tables"]),
    ("[launcher]\ndrain_timeout_s = 1\n", ["[launcher] without any [[pool]]"]),
    ("[launcher]\nnope = 1\n[[pool]]\nmodel = 'echo'\n", ["[launcher] unknown key 'nope'"]),
    ("[launcher]\nstop_timeout_s = 'x'\n[[pool]]\nmodel = 'echo'\n", ["[launcher] stop_timeout_s must be"]),
    # was capped at the most without a word
    ("[launcher]\nrestart_backoff_s = 60\n[[pool]]\nmodel = 'echo'\n",
     ["restart_backoff_s (60) is above restart_backoff_max_s (30, the default)"]),
    ("[launcher]\nrestart_backoff_max_s = 0\n[[pool]]\nmodel = 'echo'\n",
     ["restart_backoff_s (0.5, the default) is above restart_backoff_max_s (0)", "set both"]),
    ("[[pool]]\nmodel = 'echo'\ndevice = 'cpu'\ntransports = ['inline', 'cuda']\n",
     ["[[pool]] #1: transports has cuda", "device 'cpu'"]),
])
def test_pool_errors_name_the_key_in_one_line(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(C.ConfigError) as e:
        C.load_launcher(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(path + ": ")
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("text, words", [
    ("fronted = 'ipc:///x'\n", ["unknown key 'fronted'", "frontend"]),
    ("frontend = 3\n", ["frontend must be a string, not 3"]),
    ("[scheduler]\nheartbeat_interval = 'fast'\n", ["[scheduler] heartbeat_interval must be a number"]),
    ("[scheduler]\nmax_queue = 1.5\n", ["[scheduler] max_queue must be an integer"]),
    ("[scheduler]\npriority_weights = ['a']\n", ["priority_weights must be a list of numbers"]),
    ("[scheduler]\n__class__ = 1\n", ["[scheduler] unknown key '__class__'"]),
    ("scheduler = 1\n", ["scheduler must be a table"]),
    ("[broker]\nfrontend = 'ipc:///x'\n[scheduler]\nmax_queue = 1\n",
     ["unknown top-level key 'scheduler'", "with a [broker] table"]),
    ("[broker]\nbackend = 1\n", ["[broker] backend must be a string"]),
    ("[broker]\nhwm = 1\n", ["[broker] unknown key 'hwm'"]),
    ("broker = 1\n", ["broker must be a table"]),
    ("frontend = \n", ["not valid TOML"]),
])
def test_broker_keys_are_checked_too(tmp_path, text, words):
    from broker.server import BrokerConfig

    path = write(tmp_path, text)
    with pytest.raises(C.ConfigError) as e:
        BrokerConfig.from_toml(path)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(C.ConfigError, match="cannot read it"):
        C.read_toml(str(tmp_path / "nope.toml"))


# ------------------------------------------------------------------------- the broker's drain


def test_a_draining_scheduler_refuses_new_requests_and_finishes_admitted_ones():
    from broker.state import ClientError, Dispatch, ErrorCode, Scheduler, ToClient

    s = Scheduler()
    s.worker_ready(b"w", "echo", 0.0, credit=1)
    (d,) = [a for a in s.client_request(b"c", 1, "echo", 0.0, payload=None) if type(a) is Dispatch]
    s.client_request(b"c", 2, "echo", 0.0, payload=None)  # queued behind it (credit 1)
    assert s.live == 2
    s.drain("shutting down")
    (refused,) = s.client_request(b"c", 3, "echo", 0.1, payload=None)
    assert type(refused) is ClientError and refused.code == ErrorCode.SERVICE_UNAVAILABLE
    assert refused.message == "shutting down" and s.live == 2
    out = s.worker_final(b"w", d.token, 0.2)
    assert any(type(a) is ToClient for a in out)
    (d2,) = [a for a in out if type(a) is Dispatch]  # the queued one still runs
    s.worker_final(b"w", d2.token, 0.3)
    assert s.live == 0


def test_the_shipped_sample_and_the_docs_sample_parse(tmp_path):
    import re
    from pathlib import Path

    from broker.server import BrokerConfig

    root = Path(__file__).resolve().parents[2]
    ops = (root / "docs" / "operations.md").read_text()
    section = ops[ops.index("## One launcher"):]
    doc_sample = tmp_path / "doc.toml"
    doc_sample.write_text(re.search(r"```toml\n(.*?)```", section, re.S).group(1))
    for path in (str(root / "deploy" / "deploy.toml"), str(doc_sample)):
        BrokerConfig.from_toml(path)
        d = C.load_launcher(path)
        assert d is not None and d.workers >= 2
        assert all(p.worker_args("ipc:///x")[:2] == ["--broker=ipc:///x", f"--model={p.model}"] for p in d.pools)


def test_the_flags_extra_args_may_not_set_are_the_workers_and_take_no_abbreviation():
    from gpu_worker.__main__ import build_parser

    ap = build_parser()
    options = ap._option_string_actions
    assert set(C.LAUNCHERS_FLAGS) | {flag for _, flag in C._FLAGS} <= set(options)
    with pytest.raises(SystemExit):  # an abbreviation would slip past the launcher's check
        ap.parse_args(["--brok", "ipc:///x"])


@pytest.mark.parametrize("args, refused", [
    (["--health-port", "8003"], "--health-port the fixed port 8003"),
    (["--health-port=0.0.0.0:8003"], "--health-port the fixed port 8003"),
    (["--direct", "--direct-tcp", "tcp://10.0.0.5:5600"], "--direct-tcp the fixed port 5600"),
    (["--health-port", "0.0.0.0:0", "--direct-tcp=tcp://10.0.0.5:0"], None),
    (["--health-port"], None),  # no value: the worker's own parser says so
])
def test_a_fixed_port_in_extra_args_is_refused_for_the_launcher_only(tmp_path, args, refused):
    # The launcher runs a pool's workers side by side (a worker beside its replacement in a
    # rolling restart): only one binds a fixed port.  A worker run with --pool may have one.
    path = tmp_path / "deploy.toml"
    path.write_text(f"[[pool]]\nmodel = 'echo'\nextra_args = {args!r}\n".replace("'", '"'))
    d = C.load_launcher(str(path))
    if refused is None:
        C.check_launch(d)
        return
    with pytest.raises(C.ConfigError, match="rolling restart") as e:
        C.check_launch(d)
    assert refused in str(e.value) and f"{path}: [[pool]] 'echo'" in str(e.value), e.value


@pytest.mark.parametrize("pool, stop", [
    ("extra_args = ['--drain-grace-s', '60']", 70.0),
    ("extra_args = ['--drain-grace-s=5', '--drain-grace-s', '90']", 100.0),  # the last one, as argparse takes it
    ("drain_grace_s = 2\nextra_args = ['--no-warmup']", 12.0),
    ("extra_args = ['--drain-grace-s', 'soon']", 40.0),  # the worker refuses it
])
def test_the_stop_timeout_follows_a_drain_grace_given_in_extra_args(tmp_path, pool, stop):
    path = tmp_path / "deploy.toml"
    path.write_text(f"[[pool]]\nmodel = 'echo'\n{pool}\n")
    assert C.load_launcher(str(path)).stop_timeout == stop


@pytest.mark.parametrize("pools, refused", [
    ("model = 'echo'\nservice = 's'\n[[pool]]\nname = 'b'\nmodel = 'pkg.m:f'\nservice = 's'", "service 's'"),
    ("model = 'echo'\n[[pool]]\nname = 'b'\nmodel = 'pkg.m:f'\nservice = 'echo'", "service 'echo'"),
    ("model = 'pkg.m:f'\nextra_args = ['--service', 'x']\n[[pool]]\nname = 'b'\nmodel = 'pkg.m:g'\nservice = 'x'",
     "service 'x'"),
    ("model = 'echo'\ndevice = 'cpu'\n[[pool]]\nname = 'b'\nmodel = 'echo'\ndevice = 'cuda:0'", None),  # one model
    ("model = 'pkg.m:f'\n[[pool]]\nname = 'b'\nmodel = 'pkg.m:g'", None),  # services the file does not say
])
def test_pools_of_one_service_run_one_model(tmp_path, pools, refused):
    path = tmp_path / "deploy.toml"
    path.write_text(f"[[pool]]\n{pools}\n")
    if refused is None:
        assert len(C.load_launcher(str(path)).pools) == 2
        return
    with pytest.raises(C.ConfigError, match="with another model") as e:
        C.load_launcher(str(path))
    assert refused in str(e.value) and "[[pool]] #2 (name 'b')" in str(e.value), e.value


def test_the_broker_key_the_launcher_passes_its_workers_may_start_with_a_dash(tmp_path):
    """z85 has '-' among its 85 characters, so about one server key in 85 starts with one:
    passed as ``--server-key KEY``, the worker's parser took the key for an option, and every
    launched worker exited 2 ("argument --server-key: expected one argument") over a
    CurveZMQ tcp backend."""
    from types import SimpleNamespace

    from broker import security as S
    from broker.launcher import Launcher
    from gpu_worker.__main__ import build_parser

    for i in range(5000):  # one key in 85 on average
        public, secret = S.make_keys(str(tmp_path), "server", overwrite=True)
        if S.load_server_secret(secret)[0].startswith(b"-"):
            break
    else:
        pytest.fail("no key starting with '-' in 5000")
    me = SimpleNamespace(broker=SimpleNamespace(backend_ep="tcp://127.0.0.1:5556",
                                                cfg=SimpleNamespace(security=S.SecurityConfig(curve_secret=secret))))
    link = Launcher._link_args(me)
    args = build_parser().parse_args(["--broker", "tcp://127.0.0.1:5556", "--model", "echo", *link])
    assert args.server_key == S.load_server_secret(secret)[0].decode(), link
