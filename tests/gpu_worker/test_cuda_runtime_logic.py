"""The CPU-testable decisions of gpu_worker.cuda_runtime: graph buckets and capture policy
(with torch CPU tensors and an injected capture), memory-pressure decisions, keep-warm, and
the registry's bookkeeping."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from gpu_worker.cuda_runtime import (
    GpuMemoryPressure, GraphCache, HostRegisterError, HostRegistry, KeepWarm, MemoryWatch,
    bucket_for, buffer_span, default_buckets, input_signature,
)

MiB = 1 << 20


# ------------------------------------------------------------------------------ buckets

def test_default_buckets():
    assert default_buckets(1) == (1,)
    assert default_buckets(8) == (1, 2, 4, 8)
    assert default_buckets(12) == (1, 2, 4, 8, 12)
    with pytest.raises(ValueError):
        default_buckets(0)


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 12), (12, 12), (13, None)])
def test_bucket_for(n, want):
    assert bucket_for(n, (1, 2, 4, 8, 12)) == want


# ------------------------------------------------------------------------------ graph cache

@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="GraphCache is tested with torch CPU tensors")


class FakeCapture:
    """Stands in for CUDA graph capture: replay re-runs fn on the static inputs and copies the
    results into the static outputs, which is what a replayed graph does."""

    def __init__(self, fail_for: set[int] = frozenset()):
        self.calls = []
        self.fail_for = fail_for

    def __call__(self, fn, static_in):
        bucket = next(iter(static_in.values())).shape[0]
        self.calls.append(bucket)
        if bucket in self.fail_for:
            raise RuntimeError("operation not permitted when stream is capturing")
        static_out = {k: v.clone() for k, v in fn(static_in).items()}

        def replay():
            for k, v in fn(static_in).items():
                static_out[k].copy_(v)

        return replay, static_out


def model(batch):
    x = batch["x"]
    return {"y": x * 2 + 1, "s": x.sum(dim=1)}


def test_graph_cache_warms_captures_and_replays_with_padding(torch):
    cap = FakeCapture()
    gc = GraphCache(model, buckets=(1, 2, 4), warmup=2, capture=cap)
    x3 = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sig = gc.plan(3, ())[0]
    assert sig == "warmup"
    for i in range(2):
        out = gc.run({"x": x3})
        assert torch.equal(out["y"], x3 * 2 + 1)
    assert gc.stats["warmup"] == 2 and cap.calls == []
    out = gc.run({"x": x3})  # third call: captured (bucket 4) and replayed
    assert cap.calls == [4] and gc.stats["captured"] == 1
    assert out["y"].shape == (3, 4) and torch.equal(out["y"], x3 * 2 + 1)
    assert torch.equal(out["s"], x3.sum(dim=1))
    x2 = torch.ones(2, 4)  # another bucket: its own warm-up
    assert gc.plan(2, gc_sig(x2))[0] == "warmup"
    # Same bucket (4), new data: replay only, correct rows, no new capture.
    x4 = torch.full((4, 4), 3.0)
    assert gc.plan(4, gc_sig(x4))[0] == "replay"
    assert torch.equal(gc.run({"x": x4})["y"], torch.full((4, 4), 7.0))
    assert cap.calls == [4] and gc.stats["replayed"] == 2


def gc_sig(x):
    return input_signature({"x": x})


def test_graph_cache_keys_on_item_shape_and_dtype(torch):
    cap = FakeCapture()
    gc = GraphCache(model, buckets=(2,), warmup=0, capture=cap)
    gc.run({"x": torch.ones(2, 4)})
    gc.run({"x": torch.ones(2, 5)})
    gc.run({"x": torch.ones(2, 4, dtype=torch.float64)})
    assert cap.calls == [2, 2, 2] and len(gc) == 3


def test_graph_cache_too_large_runs_eager(torch):
    cap = FakeCapture()
    gc = GraphCache(model, buckets=(1, 2), warmup=0, capture=cap)
    out = gc.run({"x": torch.ones(5, 4)})
    assert out["y"].shape == (5, 4) and cap.calls == [] and gc.stats["eager"] == 1


def test_graph_cache_capture_failure_is_eager_for_good(torch):
    cap = FakeCapture(fail_for={2})
    gc = GraphCache(model, buckets=(1, 2), warmup=1, capture=cap)
    x = torch.ones(2, 3)
    for _ in range(4):
        assert torch.equal(gc.run({"x": x})["y"], x * 2 + 1)
    assert cap.calls == [2]  # tried once only
    assert gc.stats["failed"] == 1 and len(gc.failures()) == 1
    assert gc.plan(2, gc_sig(x))[0] == "eager"


def test_graph_cache_evicts_least_recent(torch):
    cap = FakeCapture()
    gc = GraphCache(model, buckets=(1, 2, 4), warmup=0, max_graphs=2, capture=cap)
    for n in (1, 2, 4):
        gc.run({"x": torch.ones(n, 2)})
    assert len(gc) == 2 and gc.stats["evicted"] == 1
    assert gc.plan(1, gc_sig(torch.ones(1, 2)))[0] == "capture"


def test_graph_cache_refuses_mixed_batch_sizes(torch):
    gc = GraphCache(model, buckets=(4,), capture=FakeCapture())
    with pytest.raises(ValueError, match="batch size"):
        gc.run({"x": torch.ones(2, 2), "z": torch.ones(3, 2)})


# ------------------------------------------------------------------------------ memory watch

class Mem:
    def __init__(self, free, total=80_000 * MiB):
        self.free, self.total, self.reads = free, total, 0

    def __call__(self):
        self.reads += 1
        return self.free, self.total


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_memory_watch_shrinks_sheds_and_recovers():
    mem, clock = Mem(10_000 * MiB), Clock()
    w = MemoryWatch(8, min_free_bytes=4000 * MiB, min_free_fraction=0.0, interval=0.1, mem_info=mem, clock=clock)
    assert w.limit() == 8 and w.admit(16) == 8
    mem.free = 3000 * MiB           # below the threshold: halve per reading
    clock.t += 0.2
    assert w.limit() == 4
    assert w.limit() == 4           # rate-limited: no new reading inside the interval
    assert mem.reads == 2
    clock.t += 0.2
    assert w.limit() == 2
    mem.free = 1500 * MiB           # below threshold * shed_below: cap 1 and shed at once
    clock.t += 0.2
    with pytest.raises(GpuMemoryPressure, match="shed") as e:
        w.admit(1)
    assert e.value.code == 429 and w.cap == 1
    mem.free = 5000 * MiB           # above the threshold but inside the hysteresis band: hold
    clock.t += 0.2
    with pytest.raises(GpuMemoryPressure):
        w.admit(1)
    mem.free = 6000 * MiB           # >= 1.5 x threshold: resume and grow back step by step
    clock.t += 0.2
    assert w.admit(8) == 2
    for want in (4, 8, 8):
        clock.t += 0.2
        assert w.limit() == want
    assert [e[0] for e in w.events] == ["shrink", "shrink", "shrink", "shed", "resume", "grow", "grow", "grow"]


def test_memory_watch_keeps_a_bounded_record_of_its_changes():
    """A device whose free memory swings across the thresholds for weeks (another process's
    cache growing and shrinking) changes the cap at every other reading: the record of
    changes kept the last few, not every one (a list of them grew for the worker's life,
    up to 20 a second: the long-uptime hunt)."""
    mem, clock = Mem(1_000 * MiB), Clock()
    w = MemoryWatch(8, min_free_bytes=4_000 * MiB, mem_info=mem, clock=clock)
    for i in range(20_000):  # a swing per reading: shed, then resume and grow
        mem.free = 1_000 * MiB if i % 2 else 9_000 * MiB
        clock.t += 1.0
        w.limit()
    assert mem.reads == 20_000
    assert len(w.events) <= 64, f"{len(w.events)} cap changes kept after 20,000 readings"
    assert w.events[-1][0] in ("shed", "grow", "shrink", "resume")


def test_memory_watch_fraction_threshold_and_oom():
    mem, clock = Mem(3_000 * MiB, total=100_000 * MiB), Clock()
    w = MemoryWatch(16, min_free_fraction=0.05, mem_info=mem, clock=clock)
    assert w.threshold(100_000 * MiB) == 5_000 * MiB
    assert w.limit() == 8  # 3000 < 5000 but above 2500: one halving
    mem.free = 50_000 * MiB
    w.on_oom()
    assert w.cap == 4
    assert w.limit() == 8  # on_oom forces a fresh reading; plenty free: grow
    with pytest.raises(ValueError):
        MemoryWatch(0, mem_info=mem)
    with pytest.raises(ValueError):
        MemoryWatch(4, shed_below=2.0, mem_info=mem)


# ------------------------------------------------------------------------------ keep-warm

def test_keep_warm_runs_only_after_idle_period():
    clock = Clock()
    runs = []
    k = KeepWarm(5.0, lambda: runs.append(clock.t), clock=clock)
    assert not k.maybe_run()
    clock.t = 4.9
    assert not k.maybe_run()
    clock.t = 5.0
    assert k.maybe_run() and runs == [5.0]
    clock.t = 7.0
    k.touch()                       # traffic: the idle clock restarts
    clock.t = 11.0
    assert not k.maybe_run()
    assert k.next_at() == 12.0
    clock.t = 12.0
    assert k.maybe_run() and k.runs == 2


def test_keep_warm_off_and_failing_warmup():
    assert not KeepWarm(None, lambda: 1 / 0).maybe_run(now=1e9)
    assert KeepWarm(0, lambda: None).next_at() is None

    def boom():
        raise RuntimeError("no")

    clock = Clock()
    k = KeepWarm(1.0, boom, clock=clock)
    clock.t = 2.0
    assert k.maybe_run() and k.runs == 1  # logged, never raised


# ------------------------------------------------------------------------------ registry

def test_buffer_span_of_mappings_and_arrays():
    mm = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    try:
        addr, size, ro = buffer_span(mm)
        assert size == 3 * mmap.PAGESIZE and addr % mmap.PAGESIZE == 0 and not ro
        a = np.zeros(10, np.uint8)
        a.flags.writeable = False
        assert buffer_span(a)[1:] == (10, True)
        assert buffer_span((4096, 100)) == (4096, 100, False)
        with pytest.raises(ValueError):
            buffer_span(np.zeros((4, 4))[:, ::2])
    finally:
        mm.close()


def test_host_registry_registers_once_and_remembers_failures():
    calls = []

    class Reg:
        def __init__(self, buf, readonly):
            calls.append((buf, readonly))
            self.unregistered = False

        def unregister(self):
            self.unregistered = True

    def register(buf, readonly=None):
        if buf == "bad":
            raise HostRegisterError("cudaHostRegister failed: invalid value", 1)
        return Reg(buf, readonly)

    r = HostRegistry(register)
    assert r.ensure("a", "buf-a", readonly=True)
    assert r.ensure("a", "buf-a")
    assert calls == [("buf-a", True)] and "a" in r
    assert not r.ensure("b", "bad") and not r.ensure("b", "bad")
    assert list(r.failures()) == ["b"] and len(calls) == 1
    reg = r._regs["a"]
    r.drop("a")
    assert reg.unregistered and "a" not in r
    r.close()
