"""The look for work to take back is skipped at events that changed nothing an idle worker
could take (broker.state, `Scheduler._recall_touched`): under random interleavings it must
change nothing else.  Each step of the recall and lease machines runs on two schedulers in
lockstep, the one under test and one made to look at everything at every event that
touches a service (what every event did before the skip): every event's actions, every
answer and the next timer must be the same."""
from __future__ import annotations

from hypothesis import settings

from broker.state import Scheduler
from tests.broker.test_state_leases_stateful import LeaseMachine
from tests.broker.test_state_stateful import RecallMachine, SchedulerMachine


class _LookAlways(dict):
    """A scheduler's set of services touched by the current event, each marked for the full
    look as it is put there."""

    def __setitem__(self, svc, value):
        svc.recall_stale = True
        super().__setitem__(svc, value)


class _Lockstep:
    """The scheduler under test, seen through its twin: every public call is made on both
    and must answer the same; private state is the one under test's."""

    def __init__(self, tested: Scheduler, reference: Scheduler):
        self._tested = tested
        self._reference = reference

    def __getattr__(self, name):
        got = getattr(self._tested, name)
        if name.startswith("_") or not callable(got):
            return got
        twin = getattr(self._reference, name)

        def both(*args, **kw):
            a = got(*args, **kw)
            b = twin(*args, **kw)
            assert a == b, f"{name}{args}: {a} != {b}"
            wake = self._tested.next_wakeup(0.0)
            assert wake == self._reference.next_wakeup(0.0), f"after {name}{args}: timers differ"
            return a
        return both


def _twin(machine):
    ref = Scheduler(machine.cfg, on_direct=lambda *a: machine.ref_directs.append(a))
    ref._dirty = _LookAlways()
    machine.ref_directs = []
    machine.s = _Lockstep(machine.s, ref)


class RecallLockstep(RecallMachine):
    def __init__(self):
        super().__init__()
        _twin(self)

    def teardown(self):
        super().teardown()
        assert self.directs == self.ref_directs


class SchedulerLockstep(SchedulerMachine):  # recall after 0.5 s: the timer's part
    def __init__(self):
        super().__init__()
        _twin(self)


class LeaseLockstep(LeaseMachine):  # leases move credit (and BUSY) under the look
    def __init__(self):
        super().__init__()
        _twin(self)


_SETTINGS = settings(RecallMachine.TestCase.settings, max_examples=40)
RecallLockstep.TestCase.settings = _SETTINGS
SchedulerLockstep.TestCase.settings = _SETTINGS
LeaseLockstep.TestCase.settings = _SETTINGS
TestRecallLockstep = RecallLockstep.TestCase
TestSchedulerLockstep = SchedulerLockstep.TestCase
TestLeaseLockstep = LeaseLockstep.TestCase


# ---- each thing that sends for the full look, on its own (the machines above seldom meet them)

from broker.state import Config, Dispatch, RecallAtWorker, ToClient  # noqa: E402

C = b"client"
V, T, Z = b"v", b"t", b"z"
SHM = frozenset({"inline", "shm"})


def _pair(**kw) -> _Lockstep:
    cfg = Config(**kw)
    ref = Scheduler(cfg)
    ref._dirty = _LookAlways()
    return _Lockstep(Scheduler(cfg), ref)


def _of(out, cls):
    return [a for a in out if isinstance(a, cls)]


def _one(out, cls):
    found = _of(out, cls)
    assert len(found) == 1, out
    return found[0]


def _kept_one():
    """V (host a) holds r1 (inline: anyone's) and r2 (asked back for T, kept: started);
    T (host b) is idle: V has one request left to give, and gives only from two."""
    s = _pair(recall_after=0.0)
    s.worker_ready(V, "svc", 0.0, credit=4, recall=True, host="a", transports=SHM)
    s.worker_ready(T, "svc", 0.0, credit=4, recall=True, host="b", transports=SHM)
    r1 = _one(s.client_request(C, 1, "svc", 0.0, payload=1), Dispatch)
    t1 = _one(s.client_request(C, 2, "svc", 0.0, payload=2), Dispatch)
    r2 = _one(s.client_request(C, 3, "svc", 0.0, payload=3), Dispatch)
    assert (r1.worker, t1.worker, r2.worker) == (V, T, V)
    rec = _one(s.worker_final(T, t1.token, 0.01, "r"), RecallAtWorker)
    assert rec.tokens == (r2.token,)
    assert not _of(s.worker_returned(V, [], 0.02, kept=rec.tokens), RecallAtWorker)
    return s, r1, r2


def test_a_request_that_makes_a_deep_worker_give_looks_again():
    s, r1, r2 = _kept_one()
    out = s.client_request(C, 4, "svc", 0.03, payload=4, local_host="a")  # only V maps it
    assert _one(out, Dispatch).worker == V and not _of(out, RecallAtWorker)  # (no look: nothing queued)
    out = s.worker_final(V, r2.token, 0.04, "r")  # the next event of the service looks
    assert _one(out, RecallAtWorker).tokens == (r1.token,)  # V has two to give: r1 is T's


def test_a_worker_newly_deep_is_looked_at():
    s, r1, r2 = _kept_one()
    assert not _of(s.worker_final(V, r2.token, 0.03, "r"), RecallAtWorker)  # V holds r1 alone
    out = s.client_request(C, 4, "svc", 0.04, payload=4, local_host="a")
    assert _one(out, RecallAtWorker).tokens == (r1.token,)


def test_the_first_idle_worker_is_looked_for():
    s, r1, _ = _kept_one()
    t2 = _one(s.client_request(C, 4, "svc", 0.03, payload=4), Dispatch)
    assert t2.worker == T  # nobody idle now
    assert not _of(s.client_request(C, 5, "svc", 0.04, payload=5, local_host="a"), RecallAtWorker)
    out = s.worker_final(T, t2.token, 0.05, "r")  # T idle again: V has two to give
    assert _one(out, RecallAtWorker).tokens == (r1.token,)


def test_a_batch_grown_old_is_looked_at_before_its_timer_fires():
    s = _pair(recall_after=0.005)
    s.worker_ready(Z, "svc", 0.0, credit=1, recall=True)
    s.worker_ready(T, "svc", 0.0, credit=1, recall=True)
    z1 = _one(s.client_request(C, 1, "svc", 0.0, payload=1), Dispatch)
    t1 = _one(s.client_request(C, 2, "svc", 0.0, payload=2), Dispatch)
    s.worker_ready(V, "svc", 0.0, credit=4, recall=True)
    assert {z1.worker, t1.worker} == {Z, T}
    held = [_one(s.client_request(C, 3 + i, "svc", 0.0, payload=i), Dispatch) for i in range(2)]
    assert {d.worker for d in held} == {V}
    assert not _of(s.worker_final(T, t1.token, 0.001, "r"), RecallAtWorker)  # V's batch is young
    assert s.next_wakeup(0.001) == 0.005
    # Past the timer, before any tick: Z's result is an event of the service; V's batch is old.
    out = s.worker_final(Z, z1.token, 0.01, "r")
    assert _one(out, RecallAtWorker).worker == V


def test_a_deep_worker_whose_oldest_request_went_sets_the_timer_for_its_next():
    s = _pair(recall_after=0.005)
    s.worker_ready(V, "svc", 0.0, credit=4, recall=True, host="a", transports=SHM)
    s.worker_ready(T, "svc", 0.0, credit=4, recall=True, host="b", transports=SHM)
    old = [_one(s.client_request(C, i, "svc", 0.0, payload=i, local_host="a"), Dispatch) for i in range(2)]
    assert s.tick(0.01) == []  # old enough, but nothing T can map
    new = [_one(s.client_request(C, 10 + i, "svc", 0.1, payload=i, local_host="a"), Dispatch) for i in range(2)]
    for d in old:
        s.worker_final(V, d.token, 0.101, "r")
    assert s.next_wakeup(0.101) == new[0].enqueued_at + 0.005  # (the twin checks the same)


def test_the_recall_timer_looks():
    s = _pair(recall_after=0.005)
    s.worker_ready(T, "svc", 0.0, credit=1, recall=True)
    s.worker_ready(V, "svc", 0.0, credit=4, recall=True)
    t1 = _one(s.client_request(C, 1, "svc", 0.0, payload=1), Dispatch)
    held = [_one(s.client_request(C, 2 + i, "svc", 0.0, payload=i), Dispatch) for i in range(2)]
    assert t1.worker == T and {d.worker for d in held} == {V}
    assert not _of(s.worker_final(T, t1.token, 0.001, "r"), RecallAtWorker)  # V's batch is young
    assert _one(s.tick(0.005), RecallAtWorker).worker == V


def test_a_worker_gone_idle_that_could_take_what_the_last_look_saw_is_looked_for():
    s = _pair(recall_after=0.0)
    s.worker_ready(T, "svc", 0.0, credit=1, recall=True)
    s.worker_ready(Z, "svc", 0.0, credit=1, recall=True)
    t1 = _one(s.client_request(C, 1, "svc", 0.0, payload=1), Dispatch)
    z1 = _one(s.client_request(C, 2, "svc", 0.0, payload=2), Dispatch)
    s.worker_ready(V, "svc", 0.0, credit=8, recall=True)
    held = [_one(s.client_request(C, 3 + i, "svc", 0.0, payload=i), Dispatch) for i in range(4)]
    assert {d.worker for d in held} == {V}
    assert len(_one(s.worker_final(T, t1.token, 0.01, "r"), RecallAtWorker).tokens) == 1  # T's credit
    assert _one(s.worker_final(Z, z1.token, 0.02, "r"), RecallAtWorker).worker == V  # V still has 3 to give
