"""A soak with faults: `python -m bench soak --faults --minutes N [--seed S] [--json PATH]`.

The fault-free soak (bench/soak.py) looks for leaks under steady load; this one looks for
them, and for wrong answers, untyped errors, hangs and failed recoveries, while processes
die around the load for many minutes.  It runs, on ipc endpoints in a temp dir (also the
children's XDG_RUNTIME_DIR, so whatever they leave there is seen):

- a broker (`--http`, `--service-grace 15`, `--max-retries 4`) and three `echo` workers
  (`--direct`; worker 0 is never faulted, so one process lives through the whole run);
- one client process of each kind (`python -m bench.soak_faults --client KIND ...`):
    small    sync `Client`, 16 B; every 25th call an `infer_stream` handle cancelled early
    big      sync `Client`, 6 MiB, alternately its `alloc()` buffer and a fresh array,
             filled with one value and an 8-byte token at a random place (checked)
    async    `AsyncClient`, 3 tasks: normal calls, calls with 0.5-5 ms deadlines, and
             calls whose task is cancelled after 0-3 ms (16 B, sometimes 64 KiB)
    pinned   `Client(pin=True)`, 16 B, every 50th call 1 MiB through shared memory
    stream   `Client.stream` (latest wins, 2 in flight), a 16 B frame every 20 ms,
             reopened every 30 s
    victim   all of the above at once, paced 5 ms (6 MiB calls unpaced), SIGKILLed mid-call
             (client-kill)
- a probe in this process: a sync `Client`, 16 B, 4 a second, 2 s timeout: its first
  answer after each fault is the fault's recovery time.

Faults come every `--every` s (jittered +-25 %) from a schedule drawn from `--seed`, each
kind at least once when the run holds four: `worker-kill` (SIGKILL of worker 1 or 2, a new
one started), `worker-drain` (SIGTERM: it drains and must exit 0; a new one started),
`client-kill` (SIGKILL of the victim, a new one started) and `broker-restart` (SIGKILL of
the broker, a new one on the same endpoints at once).  No fault comes in the last
`--settle-s` s.  Every `--sample-s` s it samples the RSS, open files and threads of every
process, `/dev/shm/zinf-*`, and the broker's `/metrics`.

Every answer is checked against its request (the echo returns its input).  The verdict is
PASS unless one of these happened (each is a reason in the report): a wrong answer; an
untyped error (anything but a `client_sdk.InferenceError`, or an asyncio cancel the caller
asked for); a call still out `--hang-margin-s` past its timeout (or a client process whose
status went stale that long); a fault after which the probe got no answer within
`--recovery-s`, or a client that got no answer after the last fault; a client that crashed
or exited by itself, or a kind with no answer at all; a drained worker, or a process
stopped at the end, exiting non-zero; `zmq_infer_requests_total{outcome="protocol_error"}`
above 0 in any broker instance; a process whose heap (RssAnon), open files or threads kept
growing (`growth`: from the first third of its samples to the last by more than 16 MiB and
10 % / 8 files / 2 threads, and from the middle third to the last by more than half that;
judged only for processes that lived `--growth-min-s`); a process, `/dev/shm/zinf-*` file
or file in the run's directory left behind.

Exit status 0 on PASS, 1 on FAIL, 130 on Ctrl-C and 143 on SIGTERM (everything is stopped
all the same, and the report says `aborted`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Callable

import numpy as np

SCHEMA = "zinf-bench-soak-faults/1"
FAULTS = ("worker-kill", "worker-drain", "client-kill", "broker-restart")
FAULT_WEIGHTS = (3, 1, 3, 1)  # beyond the one of each kind
KINDS = ("small", "big", "async", "pinned", "stream", "victim")
#: the kinds that cancel calls on purpose (a `Cancelled` is theirs to see)
CANCELLING = ("small", "async", "victim")
SERVICE = "echo"
BIG = (2048, 3072)  # 6 MiB of uint8
TIMEOUTS = {"small": 3.0, "big": 5.0, "async": 3.0, "pinned": 3.0, "stream": 2.0}
PROBE_TIMEOUT = 2.0
# growth that counts (`growth`): heap bytes and fraction of the first third's, fds, threads
GROWTH_ANON = (16 * 2**20, 0.10)
GROWTH_FDS = 8
GROWTH_THREADS = 2
SHM_DIR = "/dev/shm"
SHM_PREFIX = "zinf-"


def schedule(seconds: float, every: float, seed: int) -> list[tuple[float, str]]:
    """The faults of a run, (offset in s, kind), one every `every` s (+-25 %) before
    `seconds`; every kind once when there are four or more, the rest drawn by weight."""
    rng = random.Random(seed)
    times, t = [], every * rng.uniform(0.75, 1.25)
    while t < seconds:
        times.append(round(t, 3))
        t += every * rng.uniform(0.75, 1.25)
    n = len(times)
    if n < len(FAULTS):
        kinds = rng.sample(FAULTS, n)
    else:
        kinds = list(FAULTS) + rng.choices(FAULTS, FAULT_WEIGHTS, k=n - len(FAULTS))
        rng.shuffle(kinds)
    return list(zip(times, kinds))


# --------------------------------------------------------------------------- client process


class Tally:
    """One client process's outcomes, written to its status file (atomically) twice a
    second, so a SIGKILLed process leaves its last counts."""

    def __init__(self, kind: str, path: str, margin: float):
        self.kind, self.path, self.margin = kind, path, margin
        self.lock = threading.Lock()
        self._wlock = threading.Lock()  # (the status file's writes, whole, one at a time)
        self.outcomes: Counter = Counter()
        self.samples: dict[str, str] = {}  # the first message of each error type
        self.wrong: list[str] = []
        self.overruns: list[dict] = []
        self.in_call: dict[str, tuple[float, float]] = {}  # thread/task -> (monotonic start, timeout)
        self.last_ok = 0.0
        self.stats: Counter = Counter()

    def start(self, who: str, timeout: float) -> float:
        t0 = time.monotonic()
        self.in_call[who] = (t0, timeout)
        return t0

    def end(self, who: str, t0: float, timeout: float, outcome: str, detail: str = "") -> None:
        self.in_call.pop(who, None)
        took = time.monotonic() - t0
        with self.lock:
            self.outcomes[outcome] += 1
            if outcome == "ok":
                self.last_ok = time.monotonic()
            elif outcome == "wrong":
                if len(self.wrong) < 20:
                    self.wrong.append(f"{who}: {detail}")
            elif outcome not in self.samples and detail:
                self.samples[outcome] = detail[:300]
            if took > timeout + self.margin and len(self.overruns) < 50:
                self.overruns.append({"who": who, "outcome": outcome, "took_s": round(took, 3), "timeout_s": timeout})
            if took > timeout + self.margin:
                self.outcomes["overrun"] += 1
        if outcome == "wrong" or outcome.startswith("untyped:"):
            self.write()  # at once: a victim killed before the next half-second write loses nothing

    def failed(self, who: str, t0: float, timeout: float, e: BaseException) -> None:
        from client_sdk import InferenceError

        name = type(e).__name__ if isinstance(e, InferenceError) else f"untyped:{type(e).__name__}"
        self.end(who, t0, timeout, name, f"{type(e).__name__}: {e}")

    def note(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.stats[key] += n

    def client_stats(self, c) -> None:
        with self.lock:
            for k in ("resent_calls", "stray_replies", "broker_restarts"):
                self.stats[k] = max(self.stats[k], getattr(c, k, 0))

    def write(self, final: bool = False, **extra: Any) -> None:
        with self._wlock:  # one write at a time, snapshot to rename: never an older one last
            self._write(final, **extra)

    def _write(self, final: bool, **extra: Any) -> None:
        with self.lock:
            st = {"pid": os.getpid(), "kind": self.kind, "now": time.monotonic(), "final": final,
                  "outcomes": dict(self.outcomes), "samples": dict(self.samples), "wrong": list(self.wrong),
                  "overruns": list(self.overruns), "in_call": dict(self.in_call), "last_ok": self.last_ok,
                  "stats": dict(self.stats), **extra}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(st, f)
        os.replace(tmp, self.path)


def _equal(x: np.ndarray) -> Callable[[np.ndarray], str]:
    """'' when the answer equals `x`, else what differs."""
    def check(y: np.ndarray) -> str:
        if y.shape != x.shape or y.dtype != x.dtype:
            return f"shape/dtype {y.shape} {y.dtype}, sent {x.shape} {x.dtype}"
        return "" if np.array_equal(y, x) else "content differs"
    return check


def _wait_service(c, stop: threading.Event) -> None:
    from client_sdk import InferenceError

    while not stop.is_set():
        try:
            if c.mmi_service(SERVICE, timeout=3):
                return
        except InferenceError:
            pass
        stop.wait(0.1)


def _sync_call(t: Tally, who: str, c, x: np.ndarray, timeout: float, check) -> None:
    t0 = t.start(who, timeout)
    try:
        with c.infer(SERVICE, {"x": x}, timeout=timeout) as r:
            what = check(r["x"])
    except Exception as e:
        t.failed(who, t0, timeout, e)
        return
    t.end(who, t0, timeout, "wrong" if what else "ok", what)


def _cancelled_handle(t: Tally, who: str, c, x: np.ndarray, timeout: float, rng) -> None:
    """An `infer_stream` handle given 0-1 ms, then cancelled: Cancelled, or its answer."""
    from client_sdk import Cancelled, InferenceError

    t0 = t.start(who, timeout)
    try:
        with c.infer_stream(SERVICE, {"x": x}, timeout=timeout) as h:
            try:
                r = h.result(timeout=float(rng.choice([0.0, 0.0002, 0.001])))
            except InferenceError:
                raise
            except TimeoutError:
                h.cancel()
                try:
                    r = h.result(timeout=timeout)
                except Cancelled:
                    t.end(who, t0, timeout, "cancelled")
                    return
            with r:
                what = _equal(x)(r["x"])
    except Exception as e:
        t.failed(who, t0, timeout, e)
        return
    t.end(who, t0, timeout, "wrong" if what else "ok", what)


def run_small(ep: str, t: Tally, stop: threading.Event, seed: int, pace: float = 0.02, who: str = "small") -> None:
    from client_sdk import Client

    rng = np.random.default_rng(seed)
    timeout = TIMEOUTS["small"]
    with Client(ep, timeout=timeout) as c:
        _wait_service(c, stop)
        n = 0
        while not stop.is_set():
            n += 1
            x = rng.integers(0, 256, 16, dtype=np.uint8)
            if n % 25 == 0:
                _cancelled_handle(t, who + ".cancel", c, x, timeout, rng)
            else:
                _sync_call(t, who, c, x, timeout, _equal(x))
            t.client_stats(c)
            stop.wait(pace)


def _big_input(rng, buf: np.ndarray | None) -> tuple[np.ndarray, Callable[[np.ndarray], str]]:
    value = int(rng.integers(0, 256))
    x = np.empty(BIG, np.uint8) if buf is None else buf
    x.fill(value)
    pos = int(rng.integers(0, x.size - 8))
    token = rng.integers(0, 256, 8, dtype=np.uint8)
    x.reshape(-1)[pos:pos + 8] = token

    def check(y: np.ndarray) -> str:
        if y.shape != BIG or y.dtype != np.uint8:
            return f"shape/dtype {y.shape} {y.dtype}"
        flat = y.reshape(-1)
        if not np.array_equal(flat[pos:pos + 8], token):
            return f"token at {pos} differs"
        if int(flat[:pos].min(initial=value)) != value or int(flat[:pos].max(initial=value)) != value \
                or int(flat[pos + 8:].min(initial=value)) != value or int(flat[pos + 8:].max(initial=value)) != value:
            return f"fill differs from {value}"
        return ""
    return x, check


def run_big(ep: str, t: Tally, stop: threading.Event, seed: int, pace: float = 0.05, who: str = "big") -> None:
    from client_sdk import Client

    rng = np.random.default_rng(seed)
    timeout = TIMEOUTS["big"]
    with Client(ep, timeout=timeout) as c:
        _wait_service(c, stop)
        buf = c.alloc(BIG, np.uint8)
        n = 0
        while not stop.is_set():
            n += 1
            x, check = _big_input(rng, buf if n % 2 else None)
            _sync_call(t, who + (".alloc" if n % 2 else ".fresh"), c, x, timeout, check)
            t.client_stats(c)
            stop.wait(pace)


def run_pinned(ep: str, t: Tally, stop: threading.Event, seed: int, pace: float = 0.02, who: str = "pinned") -> None:
    from client_sdk import Client

    rng = np.random.default_rng(seed)
    timeout = TIMEOUTS["pinned"]
    with Client(ep, timeout=timeout, pin=True) as c:
        _wait_service(c, stop)
        n = 0
        while not stop.is_set():
            n += 1
            x = rng.integers(0, 256, (1 << 20) if n % 50 == 0 else 16, dtype=np.uint8)
            _sync_call(t, who, c, x, timeout, _equal(x))
            if c.pinned(SERVICE):
                t.note("calls_while_pinned")
            t.client_stats(c)
            stop.wait(pace)


def run_stream(ep: str, t: Tally, stop: threading.Event, seed: int, pace: float = 0.02, who: str = "stream",
               reopen_s: float = 30.0) -> None:
    """Frames sent every `pace` s; what came back read after each send without waiting, and
    at the stream's end until it ends.  A frame skipped (latest wins) is no outcome."""
    from client_sdk import Client, EndOfStream, InferenceError

    rng = np.random.default_rng(seed)
    timeout = TIMEOUTS["stream"]
    with Client(ep, timeout=timeout) as c:
        _wait_service(c, stop)
        while not stop.is_set():
            opened = time.monotonic()
            sent: dict[int, tuple[np.ndarray, float]] = {}
            with c.stream(SERVICE, latest_wins=True, max_in_flight=2, timeout=timeout) as st:
                while True:
                    closing = stop.is_set() or time.monotonic() - opened > reopen_s
                    if not closing:
                        x = rng.integers(0, 256, 16, dtype=np.uint8)
                        frame = st.send({"x": x})
                        sent[frame] = (x, t.start(f"{who}.{frame}", timeout))
                    while True:
                        t_recv = time.monotonic()
                        try:
                            r = st.recv(timeout=timeout + t.margin if closing else 0.0)
                        except EndOfStream:
                            break
                        except InferenceError as e:  # the frame's own error (DeadlineExceeded too)
                            _stream_error(t, who, sent, e)
                            continue
                        except TimeoutError:  # nothing has come back yet
                            if closing:  # nothing came in timeout + margin: a hang
                                t.end(f"{who}.close", t_recv, timeout, "untyped:TimeoutError",
                                      f"no frame and no end of stream in {timeout + t.margin:g} s")
                            break
                        except Exception as e:
                            _stream_error(t, who, sent, e)
                            continue
                        with r:
                            for f in [f for f in sent if f < r.frame]:  # skipped by a newer frame
                                t.in_call.pop(f"{who}.{f}", None)
                                del sent[f]
                                t.note("stream_skipped")
                            if r.frame not in sent:
                                t.end(f"{who}.{r.frame}", time.monotonic(), timeout, "wrong",
                                      f"a result for frame {r.frame}, never sent or already answered")
                                continue
                            x, t0 = sent.pop(r.frame)
                            what = _equal(x)(r["x"])
                            t.end(f"{who}.{r.frame}", t0, timeout, "wrong" if what else "ok", what)
                    if closing:
                        break
                    stop.wait(pace)
                t.note("stream_dropped", int(st.stats()["dropped"]))
            for f in sent:  # neither answered nor failed as the stream ended: dropped with it
                t.in_call.pop(f"{who}.{f}", None)
            t.note("streams_opened")
            t.client_stats(c)


def _stream_error(t: Tally, who: str, sent: dict, e: BaseException) -> None:
    """A frame's own error: the oldest frame still out, as results come in send order."""
    if sent:
        f = min(sent)
        _, t0 = sent.pop(f)
        t.failed(f"{who}.{f}", t0, TIMEOUTS["stream"], e)
    else:
        t.failed(f"{who}.?", time.monotonic(), TIMEOUTS["stream"], e)


def run_async(ep: str, t: Tally, stop: threading.Event, seed: int, pace: float = 0.02, who: str = "async",
              tasks: int = 3) -> None:
    from client_sdk import AsyncClient, InferenceError

    async def main() -> None:
        async with AsyncClient(ep, timeout=TIMEOUTS["async"]) as c:
            while not stop.is_set():
                try:
                    if await c.mmi_service(SERVICE, timeout=3):
                        break
                except InferenceError:
                    pass
                await asyncio.sleep(0.1)

            async def one(x: np.ndarray, timeout: float) -> str:
                r = await c.infer(SERVICE, {"x": x}, timeout=timeout)
                with r:
                    return _equal(x)(r["x"])

            async def task(i: int) -> None:
                rng = np.random.default_rng(seed + i)
                while not stop.is_set():
                    u = float(rng.random())
                    x = rng.integers(0, 256, (64 << 10) if u < 0.1 else 16, dtype=np.uint8)
                    if u < 0.5:
                        mode, timeout = "normal", TIMEOUTS["async"]
                    elif u < 0.8:
                        mode, timeout = "short", float(rng.choice([0.0005, 0.001, 0.002, 0.005]))
                    else:
                        mode, timeout = "cancel", TIMEOUTS["async"]
                    name = f"{who}.{mode}.{i}"
                    t0 = t.start(name, timeout)
                    try:
                        if mode == "cancel":
                            job = asyncio.ensure_future(one(x, timeout))
                            await asyncio.sleep(float(rng.choice([0.0, 0.0003, 0.001, 0.003])))
                            job.cancel()
                            try:
                                what = await job
                            except asyncio.CancelledError:
                                t.end(name, t0, timeout, "cancelled")
                                continue
                        else:
                            what = await one(x, timeout)
                    except Exception as e:
                        t.failed(name, t0, timeout, e)
                        continue
                    t.end(name, t0, timeout, "wrong" if what else "ok", what)
                    t.client_stats(c)
                    await asyncio.sleep(pace)

            await asyncio.gather(*(task(i) for i in range(tasks)))
            t.client_stats(c)

    asyncio.run(main())


def client_process(kind: str, ep: str, status: str, seed: int, margin: float) -> int:
    """One client process (`--client`): READY once its threads run, its tally in `status`
    twice a second; SIGTERM stops it (exit 0)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # A Ctrl-C at the harness's terminal reaches its whole process group: the harness stops
    # the clients (SIGTERM) with their tallies; one that died of the SIGINT lost its tally
    # and read as a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()  # a harness that died without stopping us (SIGKILL, OOM): we stop too
    t = Tally(kind, status, margin)
    plans = {"small": [(run_small, {})], "big": [(run_big, {})], "async": [(run_async, {})],
             "pinned": [(run_pinned, {})], "stream": [(run_stream, {})],
             "victim": [(run_small, {"pace": 0.005, "who": "v.small"}), (run_big, {"pace": 0.0, "who": "v.big"}),
                        (run_pinned, {"pace": 0.005, "who": "v.pinned"}),
                        (run_stream, {"pace": 0.005, "who": "v.stream", "reopen_s": 10.0}),
                        (run_async, {"pace": 0.005, "who": "v.async", "tasks": 2})]}[kind]

    def guarded(fn, i, kw) -> None:
        try:
            fn(ep, t, stop, seed * 10 + i, **kw)
        except BaseException as e:  # outside a call: the client itself failed
            with t.lock:
                t.outcomes["crashed"] += 1
                t.samples.setdefault("crashed", f"{fn.__name__}: {type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=guarded, args=(fn, i, kw), name=fn.__name__, daemon=True)
               for i, (fn, kw) in enumerate(plans)]
    for th in threads:
        th.start()
    t.write()
    print(f"READY soak-client {kind}", flush=True)
    while not stop.is_set():
        stop.wait(0.5)
        t.write()
        if os.getppid() != parent:
            stop.set()
    join_by = time.monotonic() + max(TIMEOUTS.values()) + margin + 5
    for th in threads:
        th.join(max(0.0, join_by - time.monotonic()))
    t.write(final=True, threads_left=sum(th.is_alive() for th in threads))
    return 0


# --------------------------------------------------------------------------- harness


def proc_stats(pid: int) -> dict | None:
    """RSS (bytes; `anon`: its private part, the heap; `shmem`: the shared memory it has
    touched, bounded by the pools, rings and segments it maps), open files and threads of a
    process, from /proc; None once it is gone."""
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssShmem:": "shmem", "Threads:": "threads"}
    try:
        out = dict.fromkeys(keys.values(), 0)
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k = keys.get(line.split(":", 1)[0] + ":")
                if k is not None:
                    out[k] = int(line.split()[1]) * (1 if k == "threads" else 1024)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        return out
    except (FileNotFoundError, ProcessLookupError):
        return None


def shm_files() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()


def growth(samples: list[dict]) -> dict:
    """Means of the first, middle and last third of one process's samples, per measure, and
    which measures kept growing: up by more than the limit from the first third to the last,
    and by more than half of it from the middle third to the last (a step that then holds,
    a pool or a cache filling, is not growth).  The heap (`anon`) is judged, not the shared
    memory a process has touched (`shmem`: a worker's output ring fills page by page up to
    its size) nor their sum; open files and threads are."""
    k = len(samples) // 3
    out: dict[str, Any] = {"samples": len(samples), "span_s": round(samples[-1]["t"] - samples[0]["t"], 1)}
    growing = []
    for m in ("rss", "anon", "shmem", "fds", "threads"):
        a, b, c = (statistics.fmean(s[m] for s in part) for part in
                   (samples[:k], samples[k:len(samples) - k], samples[len(samples) - k:]))
        if m in ("rss", "anon", "shmem"):
            out[f"{m}_mib"] = [round(v / 2**20, 1) for v in (a, b, c)]
        else:
            out[m] = [round(v, 1) for v in (a, b, c)]
        limit = {"anon": max(GROWTH_ANON[0], GROWTH_ANON[1] * a), "fds": GROWTH_FDS,
                 "threads": GROWTH_THREADS}.get(m)
        if limit is not None and c - a > limit and c - b > limit / 2:
            growing.append(m)
    out["growing"] = growing
    return out


class Soak:
    """The processes of one run, their samples and the faults done to them."""

    def __init__(self, d: str, seed: int, margin: float, log: Callable[[str], None],
                 logs_dir: str | None = None, log_level: str = "WARNING"):
        self.d, self.seed, self.margin, self.log = d, seed, margin, log
        self.logs_dir, self.log_level = logs_dir, log_level
        if logs_dir:
            os.makedirs(logs_dir, exist_ok=True)
        self.status_dir = os.path.join(d, "status")
        os.makedirs(self.status_dir)
        self.fe, self.be = f"ipc://{d}/fe.ipc", f"ipc://{d}/be.ipc"
        # The children run this tree's code, as this process does, wherever it was started from.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        self.env = {"XDG_RUNTIME_DIR": d, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        self.started: list[tuple[str, subprocess.Popen]] = []  # (instance name, process): every one
        self.broker: subprocess.Popen | None = None
        self.http = ""
        # (broker, its http address), set as one: a scrape reads the pair of one instance
        self._metrics: tuple[subprocess.Popen | None, str] = (None, "")
        self.workers: list[subprocess.Popen | None] = [None, None, None]
        self.clients: dict[str, subprocess.Popen] = {}
        self.status_of: dict[int, str] = {}  # client pid -> its status file
        self.n: Counter = Counter()
        self.failures: list[str] = []
        self.hangs: list[dict] = []
        self.broker_counts: dict[int, dict[str, float]] = {}  # broker pid -> its last requests_total
        # when a scrape found protocol_error risen: (monotonic time, broker pid, its count)
        self.protocol_errors: list[tuple[float, int, int]] = []
        self.lock = threading.Lock()

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        from bench.peers import start_ready

        self.n[name] += 1
        instance = f"{name}#{self.n[name]}"
        if not self.logs_dir:
            p = start_ready(args, env=self.env)
        else:  # its stderr (its log lines) in a file of its own
            with open(os.path.join(self.logs_dir, instance.replace("#", ".") + ".log"), "ab") as err:
                p = start_ready(args, env=self.env, stderr=err)
        self.started.append((instance, p))
        return p

    def start_broker(self) -> None:
        # Port 0: the kernel's pick, named in the broker's READY line (a port picked here and
        # bound by the broker later may be taken meanwhile by another process).
        b = self._start("broker", ["-m", "broker", "--frontend", self.fe, "--backend", self.be,
                                   "--http", "127.0.0.1:0", "--service-grace", "15", "--max-retries", "4",
                                   "--log-level", self.log_level])
        http = next((f.split("=", 1)[1] for f in b.ready_line.split() if f.startswith("http=")), "")
        if not http:
            raise RuntimeError(f"the broker's READY line names no http address: {b.ready_line!r}")
        self.broker, self.http = b, http
        self._metrics = (b, http)

    def start_worker(self, i: int) -> None:
        self.workers[i] = self._start(f"worker{i}", ["-m", "gpu_worker", "--broker", self.be, "--model", "echo",
                                                     "--service", SERVICE, "--direct", "--log-level", self.log_level])

    def start_client(self, kind: str) -> None:
        status = os.path.join(self.status_dir, f"{kind}.{self.n['client-' + kind] + 1}.json")
        p = self._start(f"client-{kind}", ["-m", "bench.soak_faults", "--client", kind, self.fe, status,
                                           str(self.seed * 1000 + self.n["client-" + kind] * 10 + KINDS.index(kind)),
                                           str(self.margin)])
        self.clients[kind] = p
        self.status_of[p.pid] = status

    def live(self) -> list[tuple[str, subprocess.Popen]]:
        return [(n, p) for n, p in self.started if p.returncode is None and p.poll() is None]

    def scrape(self) -> None:
        """The broker's requests_total for the service by outcome, kept as its instance's
        last word (its counters die with it)."""
        from bench.scrape import ScrapeError, fetch, snapshot

        b, http = self._metrics
        if b is None or b.poll() is not None:
            return
        try:
            snap = snapshot(fetch(f"http://{http}/metrics", timeout_s=5.0), SERVICE)
        except ScrapeError:
            return
        counts = {k.split(":", 1)[1]: v for k, v in snap.items() if k.startswith("requests:")}
        with self.lock:
            prev = self.broker_counts.get(b.pid, {})
            before = prev.get("protocol_error", 0)
            if counts.get("protocol_error", 0) > before:
                self.protocol_errors.append((time.monotonic(), b.pid, int(counts["protocol_error"])))
            # Counters only grow: of two scrapes that ended out of order, the later answer
            # keeps what the earlier one saw (the sampler's and the one before a kill).
            self.broker_counts[b.pid] = {k: max(v, prev.get(k, 0)) for k, v in {**prev, **counts}.items()}

    @staticmethod
    def _reaped(p: subprocess.Popen) -> None:
        """A process ended by a fault: its stdout pipe closed (kept, one a fault, this
        process's descriptors grew all run long)."""
        if p.stdout is not None:
            p.stdout.close()

    def _exited(self, name: str, p: subprocess.Popen) -> bool:
        """Whether ``p`` (the broker or a worker) ended by itself before a fault reached it: a
        failure (a crash a later fault would hide by replacing it)."""
        if p.poll() is None:
            return False
        self.failures.append(f"{name} ({p.pid}) exited by itself with status {p.returncode}")
        return True

    def fault(self, kind: str, rng: random.Random) -> dict:
        """One fault, done; ``t_mono`` in the event is when it took effect (the process gone,
        not the signal sent: the checks of what came after it are measured from there)."""
        t_sig = time.monotonic()
        ev: dict[str, Any] = {"fault": kind}
        if kind == "broker-restart":
            self.scrape()
            old = self.broker
            self._exited("broker", old)
            old.kill()
            old.wait(10)
            t_eff = time.monotonic()
            self._reaped(old)
            self.start_broker()
            ev.update(pid=old.pid, new_pid=self.broker.pid)
        elif kind == "client-kill":
            old = self.clients["victim"]
            old.kill()
            old.wait(10)
            t_eff = time.monotonic()
            self._reaped(old)
            self.start_client("victim")
            ev.update(pid=old.pid, new_pid=self.clients["victim"].pid)
        else:
            i = rng.choice([1, 2])
            w = self.workers[i]
            self._exited(f"worker {i}", w)
            if kind == "worker-kill":
                w.kill()
                w.wait(10)
            else:
                w.terminate()
                try:
                    w.wait(60)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait(10)
                    self.failures.append(f"drained worker {w.pid} did not exit within 60 s: killed")
                if w.returncode != 0:
                    self.failures.append(f"drained worker {w.pid} exited with status {w.returncode}")
                ev["exit_status"] = w.returncode
            t_eff = time.monotonic()
            ev["stopped_s"] = round(t_eff - t_sig, 3)
            self._reaped(w)
            self.start_worker(i)
            ev.update(worker=i, pid=w.pid, new_pid=self.workers[i].pid)
        ev["t_mono"] = t_eff
        ev["replaced_s"] = round(time.monotonic() - t_sig, 3)
        return ev

    def read_status(self, pid: int) -> dict | None:
        try:
            with open(self.status_of[pid]) as f:
                return json.load(f)
        except (OSError, ValueError, KeyError):
            return None

    def watch_clients(self) -> None:
        """A process (client, broker or worker) that ended by itself is a failure (and is
        replaced); a call out past its timeout + margin, or a status gone stale that long, is a
        hang."""
        if self._exited("broker", self.broker):
            self._reaped(self.broker)
            self.start_broker()
        for i, w in enumerate(self.workers):
            if w is not None and self._exited(f"worker {i}", w):
                self._reaped(w)
                self.start_worker(i)
        now = time.monotonic()
        limit = max(TIMEOUTS.values()) + self.margin
        for kind, p in list(self.clients.items()):
            if p.poll() is not None:
                self.failures.append(f"client {kind} ({p.pid}) exited by itself with status {p.returncode}")
                self._reaped(p)
                self.start_client(kind)
                continue
            st = self.read_status(p.pid)
            if st is None:
                continue
            if now - st["now"] > limit:
                self._hang({"client": kind, "pid": p.pid, "who": "(the whole process: no status)",
                            "for_s": round(now - st["now"], 1), "timeout_s": None})
            for who, (since, timeout) in st["in_call"].items():
                if now - since > timeout + self.margin:
                    self._hang({"client": kind, "pid": p.pid, "who": who, "since": since,
                                "for_s": round(now - since, 1), "timeout_s": timeout})

    def _hang(self, h: dict) -> None:
        key = (h["pid"], h["who"], h.get("since"))
        if not any((x["pid"], x["who"], x.get("since")) == key for x in self.hangs):
            self.hangs.append(h)
            self.log(f"HANG {h}")


def run(minutes: float = 10.0, *, seed: int = 1, every: float = 15.0, settle_s: float = 15.0,
        sample_s: float = 5.0, hang_margin_s: float = 5.0, recovery_s: float = 30.0,
        growth_min_s: float = 120.0, plan: list[tuple[float, str]] | None = None,
        logs_dir: str | None = None, log_level: str = "WARNING", log: Callable[[str], None] = print) -> dict:
    """One run (the module docstring); `plan` replaces the seeded schedule."""
    from bench.peers import signals_held

    seconds = minutes * 60.0
    if plan is None:
        plan = schedule(max(0.0, seconds - settle_s), every, seed)
    rng = random.Random(seed + 1)
    shm_before = shm_files()
    d = tempfile.mkdtemp(prefix="zinf-soakf-")
    try:
        soak = Soak(d, seed, hang_margin_s, log, logs_dir, log_level)
    except BaseException:  # (a SIGTERM now, or a --logs directory it cannot make: no temp dir left)
        shutil.rmtree(d, ignore_errors=True)
        raise
    stop = threading.Event()
    samples: dict[str, list[dict]] = {}
    shm_seen: list[int] = []
    probe_log: list[tuple[float, float, str]] = []  # (monotonic start, end, outcome)
    probe_info: dict[str, Any] = {}
    events: list[dict] = []
    aborted = None
    t0 = time.monotonic()

    def sampler() -> None:
        while not stop.is_set():
            now = time.monotonic() - t0
            for name, p in soak.live() + [("harness", None)]:
                s = proc_stats(os.getpid() if p is None else p.pid)
                if s is not None:
                    samples.setdefault(name, []).append({"t": round(now, 2), **s})
            shm_seen.append(len(shm_files() - shm_before))
            soak.scrape()
            stop.wait(sample_s)

    def probe() -> None:
        from client_sdk import Client, InferenceError

        prng = np.random.default_rng(seed + 2)
        try:
            with Client(soak.fe, timeout=PROBE_TIMEOUT) as c:
                while not stop.is_set():
                    x = prng.integers(0, 256, 16, dtype=np.uint8)
                    ts = time.monotonic()
                    try:
                        with c.infer(SERVICE, {"x": x}) as r:
                            out = "ok" if np.array_equal(r["x"], x) else "wrong"
                    except InferenceError as e:
                        out = type(e).__name__
                    except Exception as e:
                        out = f"untyped:{type(e).__name__}"
                    probe_log.append((ts, time.monotonic(), out))
                    stop.wait(0.25)
                probe_info.update(resent_calls=c.resent_calls, broker_restarts=c.broker_restarts)
        except BaseException as e:
            probe_info["crashed"] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=sampler, name="soak-sampler", daemon=True),
               threading.Thread(target=probe, name="soak-probe", daemon=True)]
    try:
        try:
            soak.start_broker()
            for i in range(3):
                soak.start_worker(i)
            for kind in KINDS:
                soak.start_client(kind)
            t0 = time.monotonic()
            for t in threads:
                t.start()
            log(f"soak with faults: {minutes:g} min, seed {seed}, {len(plan)} faults planned, dir {d}")
            end = t0 + seconds
            for at, kind in plan + [(seconds, None)]:
                while time.monotonic() < min(t0 + at, end):
                    soak.watch_clients()
                    time.sleep(min(0.5, max(0.0, t0 + at - time.monotonic())))
                if kind is None:
                    break
                ev = soak.fault(kind, rng)
                ev["t"] = round(ev["t_mono"] - t0, 2)
                events.append(ev)
                log(f"{ev['t']:8.1f} s  {kind:15s} pid {ev['pid']} -> {ev['new_pid']} ({ev['replaced_s']:.2f} s)")
            soak.watch_clients()
        except KeyboardInterrupt:
            aborted = "interrupted (SIGINT)"
        except SystemExit:  # SIGTERM (`_sigterm_exits`)
            aborted = "stopped (SIGTERM)"
        except Exception as e:
            aborted = f"{type(e).__name__}: {e}"
            soak.failures.append(f"the harness failed: {aborted}")
        # (A Ctrl-C, or `timeout`'s SIGTERM, reaches the whole process group: the broker and
        # workers drained and exited 0 on it.)
        result = _close(soak, stop, threads, shm_before, d,
                        interrupted=aborted is not None and aborted.startswith(("interrupted", "stopped")))
    finally:
        # Whatever happened above (a second interrupt included), nothing is left running: with
        # SIGINT and SIGTERM held off meanwhile (one more, raised in a wait here, stopped the
        # loop with processes and the temp dir left), delivered after.
        with signals_held():  # (Python's handlers replaced: whichever thread a signal lands on)
            stop.set()
            for _, p in soak.started:
                try:
                    if p.poll() is None:
                        p.kill()
                        p.wait(10)
                    if p.stdout is not None and not p.stdout.closed:
                        p.stdout.close()
                except Exception:  # (one that will not die: the next ones still go)
                    pass
            shutil.rmtree(d, ignore_errors=True)
    wall = time.monotonic() - t0
    return _report(soak, result, events, plan, probe_log, probe_info, samples, shm_seen, aborted, wall,
                   dict(minutes=minutes, seed=seed, every_s=every, settle_s=settle_s, sample_s=sample_s,
                        hang_margin_s=hang_margin_s, recovery_s=recovery_s, growth_min_s=growth_min_s), t0)


def _close(soak: Soak, stop: threading.Event, threads: list[threading.Thread], shm_before: set[str],
           d: str, interrupted: bool = False) -> dict:
    """Stop everything in order (clients, then the probe and sampler, then the broker's last
    count, then workers and broker, which drain and exit 0), and look for what is left.
    ``interrupted``: a Ctrl-C at the terminal reached the broker and workers too (one
    process group), which drained and exited on it: not a failure of theirs."""
    from bench.peers import stop_process

    out: dict[str, Any] = {}
    clients = list(soak.clients.items())
    for _, p in clients:
        if p.poll() is None:
            p.terminate()
    for kind, p in clients:
        try:
            p.wait(max(TIMEOUTS.values()) + soak.margin + 20)  # its calls end, then it exits 0
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        if p.returncode != 0:
            soak.failures.append(f"client {kind} ({p.pid}) exited with status {p.returncode} on SIGTERM")
    stop.set()
    for t in threads:
        if t.is_alive():
            t.join(PROBE_TIMEOUT + soak.margin + 10)
    time.sleep(2.0)  # the workers' last STATS (once a heartbeat interval) reach the broker
    soak.scrape()
    fleet = [p for p in [*soak.workers, soak.broker] if p is not None]
    for p in fleet:
        if p.poll() is not None and not (interrupted and p.returncode == 0):
            soak.failures.append(f"{p.args[2]} {p.pid} had exited by itself (status {p.returncode})")
        else:
            p.terminate()
    wait_by = time.monotonic() + 45  # the broker drains in 8 s at most, a worker once its results are released
    for p in fleet:
        was_live = p.returncode is None
        try:
            p.wait(max(0.1, wait_by - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        if was_live and p.returncode != 0:
            soak.failures.append(f"{p.args[2]} {p.pid} exited with status {p.returncode} on SIGTERM")
    for _, p in soak.started:  # the killed ones were reaped when killed; any other, now
        if p.poll() is None:
            stop_process(p)
    # Leftovers: processes naming the run's directory, /dev/shm files, files in the directory.
    left = []
    for pid, cmd in running_with(d):
        left.append(f"{pid}: {cmd[:200]}")
        try:
            os.kill(pid, signal.SIGKILL)  # ours: it names our private directory
        except OSError:
            pass
    out["left_processes"] = left
    out["left_shm"] = sorted(shm_files() - shm_before)
    out["left_files"] = sorted(os.path.relpath(os.path.join(r, n), d) for r, _, fs in os.walk(d) for n in fs
                               if not r.startswith(soak.status_dir))
    statuses = []
    for name in sorted(os.listdir(soak.status_dir)):
        if name.endswith(".json"):
            try:
                with open(os.path.join(soak.status_dir, name)) as f:
                    statuses.append(json.load(f))
            except ValueError:
                pass
    out["statuses"] = statuses
    return out


def running_with(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of the processes but this one whose command line holds ``text``
    (a run's private directory: its processes name it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(pid) != os.getpid():
            found.append((int(pid), cmd))
    return found


def _report(soak: Soak, result: dict, events: list[dict], plan, probe_log, probe_info, samples, shm_seen,
            aborted, wall: float, config: dict, t0: float) -> dict:
    reasons: list[str] = []
    cfg = config
    # Clients, by kind (every process of a kind added up: the victims' last status each).
    kinds: dict[str, dict] = {}
    last_fault = max((e["t_mono"] for e in events), default=None)
    for st in result["statuses"]:
        k = kinds.setdefault(st["kind"], {"processes": 0, "outcomes": Counter(), "stats": Counter(),
                                          "error_samples": {}, "wrong_samples": [], "overruns": []})
        k["processes"] += 1
        k["outcomes"].update(st["outcomes"])
        k["stats"].update(st["stats"])
        for e, msg in st["samples"].items():
            k["error_samples"].setdefault(e, msg)
        k["wrong_samples"] += st["wrong"][:5]
        k["overruns"] += st["overruns"][:5]
        if st.get("threads_left"):
            reasons.append(f"client {st['kind']} ({st['pid']}): {st['threads_left']} thread(s) still running at its end")
        final_instance = soak.clients.get(st["kind"]) is not None and soak.clients[st["kind"]].pid == st["pid"]
        if final_instance and last_fault is not None and st["last_ok"] < last_fault:
            reasons.append(f"client {st['kind']} ({st['pid']}) got no answer after the last fault")
    by_kind = {}
    for kind in KINDS:
        k = kinds.get(kind)
        if k is None:
            reasons.append(f"client {kind}: no status at all")
            continue
        o = k["outcomes"]
        by_kind[kind] = {"processes": k["processes"], "answers_ok": o.get("ok", 0), "wrong": o.get("wrong", 0),
                         "overruns": o.get("overrun", 0), "cancelled": o.get("cancelled", 0),
                         "errors": {e: n for e, n in sorted(o.items())
                                    if e not in ("ok", "wrong", "overrun", "cancelled")},
                         "stats": dict(k["stats"]), "error_samples": k["error_samples"],
                         "wrong_samples": k["wrong_samples"][:10], "overrun_samples": k["overruns"][:10]}
        if not o.get("ok"):
            reasons.append(f"client {kind}: no answer at all")
        if o.get("wrong"):
            reasons.append(f"client {kind}: {o['wrong']} wrong answer(s)")
        untyped = {e: n for e, n in o.items() if e.startswith("untyped:")}
        if untyped:
            reasons.append(f"client {kind}: untyped errors {untyped}")
        # Typed errors the run explains: a deadline (the short ones asked for, or a call caught
        # by a fault), and the cancellations the cancelling kinds ask for.  Anything else
        # (ProtocolError, WorkerFailed, ServiceUnavailable, BrokerUnreachable, ...) is a call
        # the faults were not to cost: the product promises each one its answer.
        allowed = {"DeadlineExceeded"} | ({"Cancelled"} if kind in CANCELLING else set())
        other = {e: n for e, n in o.items() if e not in allowed and not e.startswith("untyped:")
                 and e not in ("ok", "wrong", "overrun", "cancelled", "crashed")}
        if other:
            reasons.append(f"client {kind}: errors the faults do not explain {other} "
                           f"(e.g. {k['error_samples'].get(next(iter(other)), '?')})")
        if o.get("crashed"):
            reasons.append(f"client {kind}: crashed ({k['error_samples'].get('crashed')})")
        if o.get("overrun"):
            reasons.append(f"client {kind}: {o['overrun']} call(s) returned more than {cfg['hang_margin_s']:g} s "
                           "past their timeout")
    # The probe, and each fault's recovery: its first answer sent after the fault.
    probe = Counter(o for _, _, o in probe_log)
    if probe.get("wrong"):
        reasons.append(f"probe: {probe['wrong']} wrong answer(s)")
    if any(o.startswith("untyped:") for o in probe):
        reasons.append(f"probe: untyped errors {dict(probe)}")
    if "crashed" in probe_info:
        reasons.append(f"probe crashed: {probe_info['crashed']}")
    slow = [(ts, te) for ts, te, _ in probe_log if te - ts > PROBE_TIMEOUT + cfg["hang_margin_s"]]
    if slow:
        reasons.append(f"probe: {len(slow)} call(s) returned more than {cfg['hang_margin_s']:g} s past their timeout")
    faults = []
    for e in events:
        first = next(((ts, te) for ts, te, o in probe_log if ts >= e["t_mono"] and o == "ok"), None)
        rec = None if first is None else round(first[1] - e["t_mono"], 3)
        failed_probes = sum(1 for ts, _, o in probe_log if ts >= e["t_mono"] and o != "ok"
                            and (first is None or ts < first[0]))
        faults.append({k: v for k, v in e.items() if k != "t_mono"} | {"recovery_s": rec,
                                                                        "probe_errors_before": failed_probes})
        if rec is None or rec > cfg["recovery_s"]:
            reasons.append(f"{e['fault']} at {e['t']} s: no probe answer within {cfg['recovery_s']:g} s "
                           f"({'none at all' if rec is None else f'first after {rec} s'})")
    # Hangs, process failures, broker counts.
    for h in soak.hangs:
        reasons.append(f"hang: client {h['client']} ({h['pid']}) {h['who']} out {h['for_s']} s "
                       f"(timeout {h['timeout_s']})")
    reasons += soak.failures
    brokers: Counter = Counter()
    for counts in soak.broker_counts.values():
        brokers.update({k: int(v) for k, v in counts.items()})
    seen = [{"t": round(t - t0, 1), "broker_pid": pid, "protocol_error": n} for t, pid, n in soak.protocol_errors]
    if brokers.get("protocol_error", 0) > 0:
        reasons.append(f"the brokers counted {brokers['protocol_error']} protocol_error outcome(s) (first seen by "
                       f"the scrapes at {', '.join(str(x['t']) + ' s' for x in seen[:5])})")
    # Growth: per process instance that lived long enough.
    procs = {}
    short = 0
    for name, ss in samples.items():
        if len(ss) < 6 or ss[-1]["t"] - ss[0]["t"] < cfg["growth_min_s"]:
            short += 1
            continue
        g = growth(ss)
        procs[name] = g
        if g["growing"]:
            reasons.append(f"{name}: {', '.join(g['growing'])} kept growing over {g['span_s']} s "
                           f"(thirds: heap {g['anon_mib']} MiB, fds {g['fds']}, threads {g['threads']})")
    for what, key in (("process(es)", "left_processes"), ("/dev/shm file(s)", "left_shm"),
                      ("file(s) in the run's directory", "left_files")):
        if result[key]:
            reasons.append(f"{len(result[key])} {what} left behind: {result[key][:5]}")
    if aborted:
        reasons.insert(0, f"aborted: {aborted}")
    recov = sorted(f["recovery_s"] for f in faults if f["recovery_s"] is not None)
    median = round(statistics.median(recov), 3) if recov else None
    return {
        "schema": SCHEMA, "config": config, "wall_s": round(wall, 1), "aborted": aborted,
        "verdict": "FAIL" if reasons else "PASS", "reasons": reasons,
        "plan": [[t, k] for t, k in plan],
        "faults": faults,
        "fault_counts": dict(Counter(f["fault"] for f in faults)),
        "recovery_s": {"median": median, "max": recov[-1] if recov else None,
                       "max_by_fault": {k: max((f["recovery_s"] for f in faults
                                                if f["fault"] == k and f["recovery_s"] is not None), default=None)
                                        for k in sorted({f["fault"] for f in faults})}},
        "clients": by_kind,
        "probe": {"outcomes": dict(probe), **probe_info},
        "broker_requests_total": dict(brokers),
        "broker_instances": len(soak.broker_counts),
        "broker_counts_by_instance": {str(pid): {k: int(v) for k, v in c.items() if v}
                                      for pid, c in soak.broker_counts.items()},
        "protocol_error_seen": seen,
        "hangs": soak.hangs,
        "process_failures": soak.failures,
        "growth": {"judged": procs, "not_judged_short_lived": short, "min_span_s": cfg["growth_min_s"]},
        "shm_new_max": max(shm_seen, default=0),
        "samples": samples,  # per process instance: [{t, rss, fds, threads}], t from the start of the load
        "left_processes": result["left_processes"], "left_shm": result["left_shm"],
        "left_files": result["left_files"],
    }


def _thirds(v: list[float]) -> str:
    return " ".join(f"{x:g}" for x in v)


def print_report(r: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"{'client':8s} {'procs':>5s} {'ok':>9s} {'wrong':>5s} {'cancelled':>9s}  errors")
    for kind, c in r["clients"].items():
        p(f"{kind:8s} {c['processes']:5d} {c['answers_ok']:9d} {c['wrong']:5d} {c['cancelled']:9d}  "
          f"{c['errors'] or '-'}")
    p(f"probe: {r['probe']['outcomes']}")
    rec = r["recovery_s"]
    p(f"faults: {r['fault_counts']}; probe recovery median {rec['median']} s, max {rec['max']} s, "
      f"max by fault {rec['max_by_fault']}")
    p(f"brokers ({r['broker_instances']} instances), requests_total: {r['broker_requests_total']}")
    g = r["growth"]
    p("per process that lived long enough, means of the first, middle and last third of its samples:")
    p(f"{'process':16s} {'span s':>6s} {'RSS MiB':>21s} {'heap MiB':>21s} {'shmem MiB':>21s} {'fds':>18s} "
      f"{'threads':>15s}")
    for name, x in g["judged"].items():
        p(f"{name:16s} {x['span_s']:6.0f} {_thirds(x['rss_mib']):>21s} {_thirds(x['anon_mib']):>21s} "
          f"{_thirds(x['shmem_mib']):>21s} {_thirds(x['fds']):>18s} {_thirds(x['threads']):>15s}"
          + (f"  GROWING: {', '.join(x['growing'])}" if x["growing"] else ""))
    p(f"({g['not_judged_short_lived']} process instance(s) lived under {g['min_span_s']:g} s: not judged)")
    p(f"left behind: processes {len(r['left_processes'])}, /dev/shm files {len(r['left_shm'])}, "
      f"files {len(r['left_files'])}; hangs {len(r['hangs'])}")
    p(f"verdict: {r['verdict']}")
    for why in r["reasons"]:
        p(f"  - {why}")


def _sigterm_exits() -> None:
    """SIGTERM as SystemExit(143), so that everything started is stopped on the way out (a
    second one, during that stop, cuts it short as a second Ctrl-C does: what is still
    running is SIGKILLed, never left)."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        pass


def main(argv: list[str] | None = None, from_shell: bool | None = None) -> int:
    from_shell = argv is None if from_shell is None else from_shell
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--client"]:
        kind, ep, status, seed, margin = argv[1:6]
        return client_process(kind, ep, status, int(seed), float(margin))
    ap = argparse.ArgumentParser(prog="python -m bench soak --faults",
                                 description=__doc__.splitlines()[0],
                                 epilog="See docs/bench.md, 'Soak with faults'.")
    ap.add_argument("--faults", action="store_true", help="this mode (the fault-free soak is bench/soak.py)")
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the run (default 10)")
    ap.add_argument("--seed", type=int, default=1, help="the fault schedule's, and the clients' inputs' (default 1)")
    ap.add_argument("--every", type=float, default=15.0, help="mean seconds between faults (default 15)")
    ap.add_argument("--settle-s", type=float, default=15.0, help="no fault in the last S s (default 15)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="RSS/fds/threads and /metrics every S s (default 5)")
    ap.add_argument("--hang-margin-s", type=float, default=5.0,
                    help="a call out this long past its timeout is a hang (default 5)")
    ap.add_argument("--recovery-s", type=float, default=30.0,
                    help="the probe must be answered within S s of each fault (default 30)")
    ap.add_argument("--growth-min-s", type=float, default=120.0,
                    help="growth is judged for processes that lived at least S s (default 120)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the report there")
    ap.add_argument("--logs", default=None, metavar="DIR",
                    help="keep each process's stderr (its log) in DIR/NAME.N.log (default: discarded)")
    ap.add_argument("--log-level", default="WARNING", help="the broker's and workers' (default WARNING)")
    a = ap.parse_args(argv)
    for name in ("minutes", "every", "settle_s", "sample_s", "hang_margin_s", "recovery_s"):
        v = getattr(a, name)
        if not (v > 0 and v < 1e6):
            ap.error(f"--{name.replace('_', '-')} must be a positive number of at most 1e6, not {v}")
    if from_shell:  # a caller of main() (a test) keeps its own handler
        _sigterm_exits()
    r = run(a.minutes, seed=a.seed, every=a.every, settle_s=a.settle_s, sample_s=a.sample_s,
            hang_margin_s=a.hang_margin_s, recovery_s=a.recovery_s, growth_min_s=a.growth_min_s,
            logs_dir=a.logs, log_level=a.log_level)
    print_report(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    if r["aborted"]:  # Ctrl-C: 130; SIGTERM: 143 (the shell's numbers)
        return 143 if r["aborted"].startswith("stopped") else 130
    return 0 if r["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
