"""DevicePoolBook: the device pool's allocator and state machine, tested on the CPU.

The state-machine test keeps what the book promised (live slots, their byte ranges, states
and generations) and checks the promises after every step: live ranges are disjoint, aligned
and inside the pool, the shared words mirror the private states, generations only go up,
a stale descriptor is refused, a failed allocation changes nothing, and an emptied book can
hand out its whole capacity and all its slots again.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test,
)

from shm import FREE, IN_FLIGHT, RELEASED, WRITING, BadDescriptor, ShmFull, StaleDescriptor
from shm.cuda import ALIGN, ALIGN_LARGE, DevicePoolBook, DevicePoolFull, release_word
from shm.segment import QS, U32


class FakeHolders:
    """Holder liveness without /proc: pids die when the test says so."""

    def __init__(self):
        self.dead: set[int] = set()

    def starttime(self, pid):
        return 1000 + pid

    def alive(self, pid, starttime):
        assert starttime == 1000 + pid
        return pid not in self.dead

    def prune(self):
        return 0


def word(book, slot):
    w = book.words[slot * QS]
    return w & U32, w >> 32


# ------------------------------------------------------------------------------ examples

def test_alloc_aligns_and_orders():
    b = DevicePoolBook(4096, slots=8, align=256)
    a = b.alloc(100)
    c = b.alloc(1)
    d = b.alloc(256)
    assert (a.offset, c.offset, d.offset) == (0, 256, 512)
    assert word(b, a.slot) == (WRITING, 0)
    assert b.in_use() == 3


def test_large_alignment_and_validation():
    b = DevicePoolBook(8 * ALIGN_LARGE, slots=4, align=ALIGN_LARGE)
    assert [b.alloc(1).offset for _ in range(3)] == [0, ALIGN_LARGE, 2 * ALIGN_LARGE]
    for bad in (0, 3, 1 << 31):
        with pytest.raises(ValueError):
            DevicePoolBook(1024, align=bad)
    with pytest.raises(ValueError):
        DevicePoolBook(0)
    with pytest.raises(ValueError):
        DevicePoolBook(10, slots=0)
    assert DevicePoolBook(10).align == ALIGN == 256


def test_exhaustion_is_typed_and_explains():
    b = DevicePoolBook(1024, slots=2, align=256)
    with pytest.raises(DevicePoolFull, match="larger than the whole pool"):
        b.alloc(2048)
    b.alloc(10)
    b.alloc(10)
    with pytest.raises(DevicePoolFull, match="all 2 slots are live") as e:
        b.alloc(10)
    assert isinstance(e.value, ShmFull)  # callers that handle host pools handle this too
    assert b.try_alloc(10) is None


def test_fragmentation_message_names_the_oldest():
    b = DevicePoolBook(1024, slots=8, align=256)
    keep = b.alloc(256)
    rest = [b.alloc(256) for _ in range(3)]
    for r in rest:
        b.free(r.slot, r.generation)
    b.alloc(512)
    with pytest.raises(DevicePoolFull, match="oldest live allocation"):
        b.alloc(512)
    assert keep.offset == 0


def test_out_of_order_release_and_wrap():
    b = DevicePoolBook(1024, slots=8, align=256)
    s = [b.alloc(256) for _ in range(4)]
    # Free the middle two: nothing moves until the oldest goes.
    b.free(s[1].slot, s[1].generation)
    b.free(s[2].slot, s[2].generation)
    assert b.try_alloc(256) is None
    b.free(s[0].slot, s[0].generation)  # tail jumps over 0, 1 and 2
    n = b.alloc(512)
    assert n.offset == 0 and b.wraps == 1
    b.free(s[3].slot, s[3].generation)
    b.free(n.slot, n.generation)
    assert b.alloc(1024).offset == 0  # nothing lost


def test_free_newest_pulls_head_back():
    b = DevicePoolBook(1024, slots=8, align=256)
    keep = b.alloc(256)
    for _ in range(10):
        x = b.alloc(512)
        assert x.offset == 256
        b.free(x.slot, x.generation)
    assert keep.offset == 0 and b.wraps == 0


def test_release_reclaim_and_generations():
    b = DevicePoolBook(1024, slots=2)
    a = b.alloc(8)
    with pytest.raises(StaleDescriptor):
        b.mark_in_flight(a.slot, a.generation + 1)
    b.mark_in_flight(a.slot, a.generation)
    assert word(b, a.slot) == (IN_FLIGHT, 0)
    assert not release_word(b.words, a.slot, a.generation + 1)  # wrong generation: no store
    assert release_word(b.words, a.slot, a.generation)
    assert word(b, a.slot) == (RELEASED, 0)
    with pytest.raises(StaleDescriptor, match="already released"):
        b.mark_in_flight(a.slot, a.generation)
    assert b.reclaim() == 1
    assert word(b, a.slot) == (FREE, 1) and b.generation(a.slot) == 1
    with pytest.raises(StaleDescriptor):
        b.free(a.slot, a.generation)
    with pytest.raises(BadDescriptor):
        b.free(99, 0)


def test_reclaim_ignores_late_and_garbage_stores():
    b = DevicePoolBook(1024, slots=2)
    a = b.alloc(8)
    b.mark_in_flight(a.slot, a.generation)
    b.words[a.slot * QS] = (a.generation + 7) << 32 | RELEASED  # a forged generation
    assert b.reclaim() == 0
    assert word(b, a.slot) == (IN_FLIGHT, a.generation)  # truth restored


def test_dead_holder_is_reclaimed():
    h = FakeHolders()
    b = DevicePoolBook(1024, slots=4, holders=h)
    a = b.alloc(8)
    c = b.alloc(8)
    b.mark_in_flight(a.slot, a.generation, holder_pid=42)
    b.mark_in_flight(c.slot, c.generation, holder_pid=43)
    assert b.words[a.slot * QS + 3] == 42 and b.words[a.slot * QS + 4] == 1042
    assert b.reclaim() == 0
    h.dead.add(42)
    assert b.reclaim() == 1
    assert b.state(a.slot) == FREE and b.state(c.slot) == IN_FLIGHT
    # Re-marking (a retry) moves the slot to a new holder.
    b.mark_in_flight(c.slot, c.generation, holder_pid=44)
    h.dead.add(43)
    assert b.reclaim() == 0
    with pytest.raises(ValueError):
        b.mark_in_flight(c.slot, c.generation, holder_pid=0)


def test_zero_byte_slots_stay_out_of_the_ring():
    b = DevicePoolBook(256, slots=4)
    z = b.alloc(0)
    full = b.alloc(256)
    assert z.nbytes == 0 and full.offset == 0
    b.free(full.slot, full.generation)
    assert b.alloc(256).offset == 0


def test_generation_wraps_at_32_bits():
    b = DevicePoolBook(64, slots=1)
    b._gen[0] = U32
    a = b.alloc(1)
    b.free(a.slot, a.generation)
    assert b.generation(0) == 0


def test_on_free_hook_sees_every_return_to_free():
    freed = []
    b = DevicePoolBook(1024, slots=4, on_free=freed.append)
    a, c = b.alloc(1), b.alloc(1)
    b.free(a.slot, a.generation)
    b.mark_in_flight(c.slot, c.generation)
    release_word(b.words, c.slot, c.generation)
    b.reclaim()
    assert freed == [a.slot, c.slot]


# ------------------------------------------------------------------------------ state machine

STATS = {"wraps": 0, "full": 0}


class BookMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.holders = FakeHolders()
        self.live: dict[int, dict] = {}     # slot -> {gen, off, nb, state, holder, age}
        self.released: dict[int, dict] = {}
        self.dead: list[tuple[int, int]] = []
        self.last_gen: dict[int, int] = {}
        self.age = 0

    @initialize(capacity=st.sampled_from([256, 1000, 4096]), slots=st.integers(1, 10),
                align=st.sampled_from([1, 64, 256]))
    def setup(self, capacity, slots, align):
        self.book = DevicePoolBook(capacity, slots=slots, align=align, holders=self.holders)

    def teardown(self):
        if hasattr(self, "book"):
            STATS["wraps"] += self.book.wraps

    def _alloc(self, nbytes):
        before = {s: self.book.get(s) for s in self.live}
        got = self.book.try_alloc(nbytes)
        self._sync()
        if got is None:
            STATS["full"] += 1
            # Nothing still live moved (reclaim inside try_alloc may have freed some).
            assert {s: self.book.get(s) for s in self.live} == {s: before[s] for s in self.live}
            if self.book.in_use() == 0:
                assert nbytes > self.book.capacity, "an empty book refused a request that fits"
            return
        assert got.nbytes == nbytes and got.slot not in self.live and got.slot not in self.released
        if got.slot in self.last_gen:
            assert got.generation > self.last_gen[got.slot] or got.generation == 0
        self.last_gen[got.slot] = got.generation
        self.age += 1
        self.live[got.slot] = dict(gen=got.generation, off=got.offset, nb=nbytes, state=WRITING, holder=None,
                                   age=self.age)

    def _sync(self):
        # try_alloc may reclaim on its own: released and dead-holder slots go.
        for s, e in list(self.released.items()):
            if self.book.generation(s) != e["gen"]:
                del self.released[s]
                self.dead.append((s, e["gen"]))
        for s, e in list(self.live.items()):
            if e["state"] == IN_FLIGHT and e["holder"] in self.holders.dead:
                if self.book.generation(s) != e["gen"]:
                    del self.live[s]
                    self.dead.append((s, e["gen"]))

    @rule(data=st.data())
    def alloc(self, data):
        cap = self.book.capacity
        self._alloc(data.draw(st.one_of(st.sampled_from([0, 1, cap, cap + 1]), st.integers(0, cap + 8))))

    @rule(data=st.data())
    def alloc_small(self, data):
        self._alloc(data.draw(st.integers(1, max(1, self.book.capacity // 4))))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def owner_free(self, data):
        s = data.draw(st.sampled_from(sorted(self.live)))
        e = self.live.pop(s)
        self.book.free(s, e["gen"])
        self.dead.append((s, e["gen"]))

    @precondition(lambda self: self.live)
    @rule()
    def owner_free_oldest(self):
        s = min(self.live, key=lambda k: self.live[k]["age"])
        e = self.live.pop(s)
        self.book.free(s, e["gen"])
        self.dead.append((s, e["gen"]))

    @rule(k=st.integers(3, 5))
    def fifo_churn(self, k):
        for _ in range(2 * k):
            self._alloc(self.book.capacity // k + 1)
            if self.live and len(self.live) + len(self.released) >= min(k, self.book.slots):
                self.owner_free_oldest()

    @precondition(lambda self: any(e["state"] == WRITING for e in self.live.values()))
    @rule(data=st.data(), holder=st.sampled_from([None, 7, 8]))
    def hand_off(self, data, holder):
        s = data.draw(st.sampled_from(sorted(k for k, e in self.live.items() if e["state"] == WRITING)))
        e = self.live[s]
        if holder is not None and holder in self.holders.dead:
            holder = None
        self.book.mark_in_flight(s, e["gen"], holder_pid=holder)
        e["state"], e["holder"] = IN_FLIGHT, holder

    @precondition(lambda self: any(e["state"] == IN_FLIGHT for e in self.live.values()))
    @rule(data=st.data())
    def reader_releases(self, data):
        s = data.draw(st.sampled_from(sorted(k for k, e in self.live.items() if e["state"] == IN_FLIGHT)))
        e = self.live.pop(s)
        assert release_word(self.book.words, s, e["gen"])
        self.released[s] = e

    @rule(pid=st.sampled_from([7, 8]))
    def holder_dies(self, pid):
        self.holders.dead.add(pid)

    @rule()
    def reclaim(self):
        expect = set(self.released)
        expect |= {s for s, e in self.live.items() if e["state"] == IN_FLIGHT and e["holder"] in self.holders.dead}
        assert self.book.reclaim() == len(expect)
        for s in expect:
            e = self.released.pop(s, None) or self.live.pop(s)
            self.dead.append((s, e["gen"]))

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def stale_refused(self, data):
        s, g = data.draw(st.sampled_from(self.dead))
        if self.book.generation(s) == g and self.book.state(s) != FREE:
            return  # generation wrapped back (impossible here) - nothing to check
        with pytest.raises(StaleDescriptor):
            self.book.free(s, g)
        with pytest.raises(StaleDescriptor):
            self.book.mark_in_flight(s, g)
        assert not release_word(self.book.words, s, g)

    @rule()
    def drain_then_take_everything(self):
        for s, e in list(self.live.items()):
            self.book.free(s, e["gen"])
            self.dead.append((s, e["gen"]))
        self.live.clear()
        self.book.reclaim()
        for s, e in self.released.items():
            self.dead.append((s, e["gen"]))
        self.released.clear()
        assert self.book.in_use() == 0
        whole = self.book.alloc(self.book.capacity)
        assert whole.offset == 0
        self.book.free(whole.slot, whole.generation)
        refs = [self.book.alloc(0) for _ in range(self.book.slots)]
        with pytest.raises(DevicePoolFull):
            self.book.alloc(0)
        for r in refs:
            self.book.free(r.slot, r.generation)
            self.dead.append((r.slot, r.generation))

    @invariant()
    def promises_hold(self):
        if not hasattr(self, "book"):
            return
        spans = []
        for s, e in list(self.live.items()) + list(self.released.items()):
            assert 0 <= e["off"] and e["off"] + e["nb"] <= self.book.capacity
            assert e["off"] % self.book.align == 0
            if e["nb"]:
                spans.append((e["off"], e["off"] + e["nb"]))
            state, gen = word(self.book, s)
            assert gen == e["gen"]
            want = RELEASED if s in self.released else e["state"]
            assert state == want, (s, state, want)
            assert self.book.get(s)[1:] == (e["gen"], e["off"], e["nb"])
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0, f"overlap [{a0},{a1}) [{b0},{b1})"
        assert self.book.in_use() == len(self.live) + len(self.released)
        for s in range(self.book.slots):
            if s not in self.live and s not in self.released:
                assert word(self.book, s)[0] == FREE


def test_book_state_machine():
    STATS.update(wraps=0, full=0)
    run_state_machine_as_test(BookMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    assert STATS["wraps"] > 0 and STATS["full"] > 0
