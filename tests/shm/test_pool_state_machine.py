"""Model-based test of the allocator: random allocations, owner frees, remote releases.

The model does not re-implement the ring; it keeps what the pool promised (live slots,
their bytes and generations) and checks the promises after every step: no two live
allocations overlap, all lie aligned inside the data area, each holds the pattern written
to it, generations only go up, nothing leaks (an emptied pool can hand out its whole
capacity again), and a failed allocation changes nothing.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test,
)

from shm import (
    FREE, IN_FLIGHT, RELEASED, WRITING, SegmentCache, ShmFull, ShmPool, StaleDescriptor,
)

STATS = {"wraps": 0, "full": 0, "examples": 0}


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: ShmPool | None = None
        self.cache: SegmentCache | None = None
        self.live: dict[int, tuple] = {}  # slot -> (ref, array, pattern, age); WRITING/IN_FLIGHT
        self.released: dict[int, tuple] = {}  # slot -> (ref, array, pattern); reader released
        self.dead: list = []  # refs of freed slots
        self.last_gen: dict[int, int] = {}
        self.counter = 0

    @initialize(
        capacity=st.sampled_from([256, 1000, 4096]),
        slots=st.integers(1, 12),
        align=st.sampled_from([1, 8, 64, 256]),
    )
    def setup(self, capacity, slots, align):
        self.pool = ShmPool(capacity, slots=slots, align=align)
        self.cache = SegmentCache()
        STATS["examples"] += 1

    def teardown(self):
        if self.pool is not None:
            STATS["wraps"] += self.pool._wraps
            self.pool.close()
        if self.cache is not None:
            self.cache.close()

    # ------------------------------------------------------------------ helpers
    def _record(self, slot):
        r = self.pool.table[slot]
        return int(r["state"]), int(r["generation"]), int(r["offset"]), int(r["nbytes"])

    def _sync_released(self):
        """Slots the pool reclaimed on its own (inside alloc) leave the released set."""
        for slot, (ref, _, _) in list(self.released.items()):
            state, gen, _, _ = self._record(slot)
            if state == RELEASED:
                assert gen == ref.generation
            else:
                assert gen > ref.generation
                del self.released[slot]
                self.dead.append(ref)

    def _pattern(self):
        self.counter += 1
        return self.counter % 251 + 1

    # ------------------------------------------------------------------ rules
    @rule(data=st.data(), raw=st.booleans())
    def alloc(self, data, raw):
        cap = self.pool.capacity
        nbytes = data.draw(
            st.one_of(st.sampled_from([0, 1, 63, 64, 65, cap, cap + 1]), st.integers(0, cap + 64)),
            label="nbytes",
        )
        self._alloc(nbytes, raw)

    @rule(data=st.data())
    def alloc_small(self, data):
        # Sizes that let several allocations coexist, so the ring fills, wraps and sees
        # frees out of order; a second alloc rule makes them the common case.
        cap = self.pool.capacity
        self._alloc(data.draw(st.integers(1, max(1, cap // 4)), label="nbytes"), False)

    def _alloc(self, nbytes, raw):
        before_live = dict(self.live)
        records = {s: self._record(s) for s in self.live}
        in_use_before = self.pool.in_use()
        if raw:
            try:
                ref, mv = self.pool.alloc_nbytes(nbytes)
                arr = np.frombuffer(mv, np.uint8)
            except ShmFull:
                ref = None
        else:
            arr = self.pool.try_alloc((nbytes,), np.uint8)
            ref = None if arr is None else self.pool.ref_of(arr)
        self._sync_released()
        if ref is None:
            STATS["full"] += 1
            # Nothing the pool promised before has changed.
            assert self.live == before_live
            assert {s: self._record(s) for s in self.live} == records
            assert self.pool.in_use() == len(self.live) + len(self.released)
            assert self.pool.in_use() <= in_use_before
            if self.pool.in_use() == 0:
                assert nbytes > self.pool.capacity, "an empty pool refused a request that fits"
            return
        assert ref.nbytes == nbytes and arr.nbytes == nbytes
        assert ref.slot not in self.live and ref.slot not in self.released
        if ref.slot in self.last_gen:
            assert ref.generation > self.last_gen[ref.slot]
        self.last_gen[ref.slot] = ref.generation
        assert self._record(ref.slot) == (WRITING, ref.generation, ref.offset, nbytes)
        pat = self._pattern()
        arr[:] = pat
        self.live[ref.slot] = (ref, arr, pat, self.counter)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def owner_free(self, data):
        slot = data.draw(st.sampled_from(sorted(self.live)))
        ref = self.live.pop(slot)[0]
        self.pool.free(ref)
        assert self._record(slot)[:2] == (FREE, ref.generation + 1)
        self.dead.append(ref)

    @precondition(lambda self: self.live)
    @rule()
    def owner_free_oldest(self):
        # First-in-first-out, the usual request pattern: this is what drives the ring
        # around and makes it wrap.  (Random frees above give the out-of-order cases.)
        slot = min(self.live, key=lambda s: self.live[s][3])
        ref = self.live.pop(slot)[0]
        self.pool.free(ref)
        self.dead.append(ref)

    @rule(size=st.integers(3, 5))
    def fifo_churn(self, size):
        # A burst of the steady-state pattern: allocate ~1/size of the pool, and when it
        # does not fit, free the oldest allocation.  From whatever state the random rules
        # left behind, this walks the ring past its end.
        for _ in range(2 * size):
            self._alloc(self.pool.capacity // size + 1, False)
            if self.live and len(self.live) + len(self.released) >= min(size, self.pool.slots):
                self.owner_free_oldest()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def send_and_remote_release(self, data):
        slot = data.draw(st.sampled_from(sorted(self.live)))
        ref, arr, pat, _ = self.live[slot]
        self.pool.mark_in_flight(ref)
        assert self._record(slot)[0] == IN_FLIGHT
        view = self.cache.view(ref, np.uint8, ref.nbytes)
        assert (view == pat).all()
        self.cache.release(ref)
        del self.live[slot]
        self.released[slot] = (ref, arr, pat)

    @rule()
    def reclaim(self):
        expected = len(self.released)
        assert self.pool.reclaim() == expected
        for ref, _, _ in self.released.values():
            self.dead.append(ref)
        self.released.clear()

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def stale_descriptors_are_refused(self, data):
        ref = data.draw(st.sampled_from(self.dead))
        with pytest.raises(StaleDescriptor):
            self.pool.free(ref)
        with pytest.raises(StaleDescriptor):
            self.cache.view(ref, np.uint8, ref.nbytes)

    @rule()
    def drain_then_take_everything(self):
        for ref, *_ in self.live.values():
            self.pool.free(ref)
            self.dead.append(ref)
        self.live.clear()
        self.pool.reclaim()
        for ref, _, _ in self.released.values():
            self.dead.append(ref)
        self.released.clear()
        assert self.pool.in_use() == 0
        whole = self.pool.alloc(self.pool.capacity, np.uint8)  # no bytes lost
        ref = self.pool.ref_of(whole)
        assert ref.offset == self.pool.data_offset
        self.pool.free(ref)
        self.dead.append(ref)
        # ...and no slots lost.
        refs = [self.pool.alloc_nbytes(0)[0] for _ in range(self.pool.slots)]
        with pytest.raises(ShmFull):
            self.pool.alloc_nbytes(0)
        for r in refs:
            self.pool.free(r)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def allocations_are_disjoint_aligned_inside_and_intact(self):
        if self.pool is None:
            return
        lo = self.pool.data_offset
        hi = lo + self.pool.capacity
        spans = []
        for ref, arr, pat, *_ in list(self.live.values()) + list(self.released.values()):
            assert lo <= ref.offset and ref.offset + ref.nbytes <= hi
            assert ref.offset % self.pool.align == 0
            assert (arr == pat).all(), "an allocation's bytes were overwritten"
            if ref.nbytes:
                spans.append((ref.offset, ref.offset + ref.nbytes))
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0, f"overlap: [{a0},{a1}) and [{b0},{b1})"
        assert self.pool.in_use() == len(self.live) + len(self.released)


def test_pool_state_machine():
    STATS.update(wraps=0, full=0, examples=0)
    run_state_machine_as_test(
        PoolMachine,
        settings=settings(
            max_examples=80,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    # The interesting paths were really exercised, not just reachable in principle.
    print(STATS)
    assert STATS["wraps"] > 0
    assert STATS["full"] > 0
