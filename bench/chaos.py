"""Faults under load: `python -m bench.chaos --seconds 60`.

Every failure mode the project guards against has its own end-to-end test, one fault at a
time.  This puts them together, the way production does: a broker and several `echo`
workers (with `--direct`, so that pinned clients lease them) on ipc endpoints in a temp dir,
clients of every kind sending without pause, and every `--every` seconds (jittered, from a
seeded random schedule) one fault:

  kill-worker     SIGKILL of a worker, a new one started in its place
  drain-worker    SIGTERM of a worker (it drains and exits), a new one started in its place
  hang-worker     SIGSTOP of a worker for `--hang-s` (longer than the broker's liveness
                  window: it is presumed dead and its requests go elsewhere), then SIGCONT
  restart-broker  SIGKILL of the broker, a new one on the same endpoints at once
  outage          SIGKILL of the broker, a new one a third of `--hang-s` later (inside the
                  clients' liveness window)
  kill-workers    SIGKILL of every worker at once, as many new ones started (requests
                  wait at the broker meanwhile)
  hang-broker     SIGSTOP of the broker for a third of `--hang-s` (shorter than every
                  liveness window: nobody may be presumed dead for it), then SIGCONT
  reset           (`--tcp` only) every client connection reset (RST both ways) by the relay
                  the clients reach the broker through (`bench.relay`): a middlebox's cut
  kill-client     SIGKILL of a client process (`python -m bench.chaos --client`: pinned,
                  its input in its shared memory, requests in flight), a new one started:
                  its leases, requests and memory must be cleaned up by the others

With `--hostile`, a hostile peer runs through the whole run as a process of its own
(`python -m bench.hostile`): mutated messages of every kind on its frontend connection,
requests whose descriptors copy slots in flight of the other processes' real segments
(clients' inputs, workers' output rings: refused, or the run fails, status 4), floods,
spells of not reading its replies, big inline requests, junk on the workers' direct
sockets and local links.  Nothing it sends may fail another client's request or end a
process.

The clients, each a thread (or an asyncio task) of this process:

  small     sync `Client`, 16 B inline, new random bytes every request
  frame     sync `Client`, a 256 KiB input in its shared memory, refilled every request
  pinned    sync `Client(pin=True)`, 16 B (leases, the worker's direct path, failover)
  async     `AsyncClient`, 4 tasks, 16 B
  stream    sync `Client.stream` (latest wins, 2 in flight; pinned by default), a 16 B
            frame every 5 ms, results read as they come (a dropped frame is no failure)
  pipelined sync `Client` (`heartbeat_interval=0.6`: its own liveness window is 3 s,
            more than an outage and the new broker's start), sends two requests, then does not
            call into the client for up to 4.5 s (the program does something else: longer
            than the broker's client liveness window and than its own), then collects both
            results (with `--tcp` the broker forgets it meanwhile, and it sends them
            again when it is back: docs/client.md)

With `--tcp` the broker's frontend is tcp (`--insecure`: the run is about faults, not keys)
and the clients reach it through `bench.relay`, which can reset their connections: inline
tensors only, replies through the broker, no leases (pinned clients stay brokered), and the
client liveness is the tcp one (silence counts, connections are replaced under the clients).

Every reply is checked against its request (the echo returns its input): a reply that
differs is `wrong`, the one outcome that must never happen.  Every other outcome is counted
by kind: `ok`, or the exception's class (with a request timeout of `--timeout` s, any error
at all is a request lost to a fault, which the design says should not happen either: a
worker's death, drain or hang is retried elsewhere, a broker restart resent by the client).
After the last fault the clients keep going for `--settle-s` seconds, then everything stops
(SIGTERM) and the run reports, per client, the outcomes, the p50 and the longest request,
the faults in order, and the shared-memory files (`/dev/shm/zinf-*`) left behind.

Two broker settings are the run's, not the defaults, because two faults go past what the
defaults are for.  kill-workers leaves the service with no worker until the new ones have
started (seconds: torch is imported), longer than the default `service_grace` (1 s, after
which a request fails with SERVICE_UNAVAILABLE): `--service-grace 30` here, as a
deployment whose workers restart on their own would set it.  And when several workers die
at once, a request can be charged a death by each of them: its worker died, it was
dispatched again at once to one that was dying too (one whose connection has not closed
yet: the broker cannot tell a request that killed its worker from one that was merely
there), and so on; `max_retries` (default 2) counts deaths to stop a request that kills
every worker it meets, so a pool whose workers can die together wants at least as many
retries as it has workers: `--max-retries` is workers + 1 here (docs/operations.md).

With `--counts` each broker instance runs with `--http` and its `/metrics` is scraped at the
end of its life (just before a restart's SIGKILL, and at the close once every client has
stopped and the workers' last STATS are in), and the sum over instances of
`zmq_infer_requests_total{service="echo"}` is held to what the clients got: no more ok than
the clients' ok replies plus the calls they sent again (`resent_calls`: a resend may be
counted by each broker or connection that saw it), the stream frames they skipped and the
client processes killed (a direct reply may have gone before the kill); no error outcome
beyond those resends and kills (every call succeeded); and, when no broker or worker was
SIGKILLed (a killed one takes with it what it counted after its last scrape, or its last
STATS), no fewer ok than the clients got.  A mismatch fails the run.

Exit status 0 when nothing was wrong (the client process counts: it exits 3 on a wrong
reply), no request failed, every client got replies and ended (a client that raised outside
a request counts as `crashed`), every process ended as it should (a drained worker with 0),
and nothing was left behind.
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
from typing import Any

import numpy as np

from bench.peers import PeerStartError, signals_held, wait_ready

SHM_DIR = "/dev/shm"
SHM_PREFIX = "zinf-"
FAULTS = ("kill-worker", "drain-worker", "hang-worker", "restart-broker", "outage", "kill-workers", "hang-broker",
          "kill-client")
TCP_FAULTS = (*FAULTS, "reset")
CLIENTS = ("small", "frame", "pinned", "async", "pipelined", "stream")
PIPELINED_QUIET_S = 4.5  # the longest the pipelined client leaves its requests unattended


def _shm_files() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


def _requests_total(http: str) -> dict[str, int]:
    """zmq_infer_requests_total{service="echo"} by outcome, from the broker's /metrics."""
    from bench.scrape import fetch, snapshot

    snap = snapshot(fetch(f"http://{http}/metrics", timeout_s=10.0), "echo")
    return {k.split(":", 1)[1]: int(v) for k, v in snap.items() if k.startswith("requests:")}


def _last_json(out: bytes) -> dict | None:
    """The last line of `out` that is a JSON object (a process's report as it ended)."""
    for line in reversed(out.decode(errors="replace").splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict):
            return v
    return None


class Fleet:
    """The broker and the workers, on ipc endpoints in `d`, and the faults done to them."""

    def __init__(self, d: str, heartbeat: float, workers: int, broker_args: tuple[str, ...] = (),
                 model: str = "echo", tcp: bool = False, hostile_seed: int | None = None, counts: bool = False):
        self.fe, self.be = f"ipc://{d}/fe.ipc", f"ipc://{d}/be.ipc"
        self.relay = None
        self.client_ep = self.fe  # where the clients connect
        if tcp:
            from bench.peers import free_port
            from bench.relay import Relay

            port = free_port()
            self.fe = f"tcp://127.0.0.1:{port}"
            broker_args = (*broker_args, "--insecure")
            self.relay = Relay(port)
            self.client_ep = f"tcp://127.0.0.1:{self.relay.port}"
        self.model = model
        self.hb = heartbeat
        self.d = d
        self.broker_args = list(broker_args)
        # --counts: each broker instance's zmq_infer_requests_total{service="echo"} by outcome,
        # scraped at the end of its life (a restart resets them): [{pid, why, outcomes}]
        self.counts = counts
        self.broker_http: str | None = None
        self.scrapes: list[dict] = []
        self.client_files: list[str] = []  # each client process's count of its ok replies
        if counts:
            self.broker_args += ["--http", "127.0.0.1:0"]
        self.broker: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None
        self.hostile: subprocess.Popen | None = None  # `bench.hostile`, with --hostile
        self.hostile_report: dict | None = None  # what it printed as it ended
        self.workers: list[subprocess.Popen] = []
        self.gone: list[subprocess.Popen] = []  # ended by a fault: reaped at close
        # Every process started, kept as Popen returns (signals held meanwhile: a Ctrl-C or
        # SIGTERM raised inside Popen left the child running, untracked): close() reaps
        # those an interrupt kept from their place above.
        self.spawned: list[subprocess.Popen] = []
        self.wrong = 0  # wrong replies the client process saw (its exit status 3)
        self.failures: list[str] = []  # what went wrong with the processes themselves
        try:
            self.start_broker()
            for _ in range(workers):
                self.workers.append(self.start_worker())
            self.client = self.start_client()
            if hostile_seed is not None:
                self._hostile_log = os.path.join(d, "hostile.stderr")  # its traceback, should it fail
                with open(self._hostile_log, "wb") as err:
                    self.hostile = self._spawn(["-m", "bench.hostile", "--frontend", self.client_ep,
                                                "--seed", str(hostile_seed)], stderr=err)
        except BaseException:
            self.close()
            raise

    def _spawn(self, args: list[str], stderr=subprocess.DEVNULL) -> subprocess.Popen:
        with signals_held():
            p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=stderr,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self.spawned.append(p)
        try:
            p.ready_line = wait_ready(p, 120)
        except BaseException:  # PeerStartError, or an interrupt while it starts: not left running
            p.kill()
            p.wait(10)
            p.stdout.close()
            raise
        return p

    def start_broker(self) -> None:
        self.broker = self._spawn(["-m", "broker", "--frontend", self.fe, "--backend", self.be,
                                   "--heartbeat-interval", str(self.hb), *self.broker_args])
        if self.counts:
            self.broker_http = next(f.split("=", 1)[1] for f in self.broker.ready_line.split() if f.startswith("http="))

    def scrape(self, why: str, settle: bool = False) -> None:
        """With --counts: the broker's requests_total for `echo`, by outcome, kept as this
        instance's last word (just before a planned kill or the close).  `settle`: until two
        scrapes a few heartbeat intervals apart agree (pinned requests come in the workers'
        STATS; direct replies' counts in their DONEs), once nothing is sent any more."""
        if not self.counts or self.broker is None or self.broker.poll() is not None:
            return
        try:
            got = _requests_total(self.broker_http)
            if settle:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    time.sleep(3 * self.hb)  # STATS come once an interval: a pace, not a synchronisation
                    again = _requests_total(self.broker_http)
                    if again == got:
                        break
                    got = again
        except OSError as e:
            self.failures.append(f"broker {self.broker.pid}: /metrics could not be scraped ({why}): {e}")
            return
        self.scrapes.append({"pid": self.broker.pid, "why": why, "outcomes": got})

    def start_worker(self) -> subprocess.Popen:
        return self._spawn(["-m", "gpu_worker", "--broker", self.be, "--model", self.model, "--service", "echo", "--direct",
                            "--heartbeat-interval", str(self.hb)])

    def start_client(self) -> subprocess.Popen:
        """A client process (`--client`), once it has had a reply."""
        f = os.path.join(self.d, f"client-{len(self.client_files)}.count")
        self.client_files.append(f)
        return self._spawn(["-m", "bench.chaos", "--client", self.client_ep, f])

    def fault(self, kind: str, rng: random.Random, hang_s: float) -> str:
        """Do one fault; what was done, in words."""
        if kind == "reset":
            n = self.relay.accepted
            self.relay.cut()
            return f"client connections reset ({n} accepted so far)"
        if kind == "kill-client":
            old = self.client
            self.note_client_exit(old)
            old.kill()
            old.wait(10)
            self.gone.append(old)
            self.client = self.start_client()
            return f"client {old.pid} killed, {self.client.pid} started"
        if kind == "hang-broker":
            self.broker.send_signal(signal.SIGSTOP)
            try:
                time.sleep(hang_s / 3)  # the fault itself
            finally:
                self.broker.send_signal(signal.SIGCONT)
            return f"broker {self.broker.pid} stopped for {hang_s / 3:g} s"
        if kind in ("restart-broker", "outage"):
            self.scrape(kind)  # its last word: the kill follows at once
            old = self.broker
            old.kill()
            old.wait(10)
            self.gone.append(old)
            if kind == "outage":
                time.sleep(hang_s / 3)  # the fault itself: no broker this long
            self.start_broker()
            return f"broker {old.pid} killed, {self.broker.pid} started" + (
                f" {hang_s / 3:g} s later" if kind == "outage" else "")
        if kind == "kill-workers":
            old = list(self.workers)
            for w in old:
                w.kill()
            for w in old:
                w.wait(10)
            self.gone.extend(old)
            self.workers = []
            for _ in old:  # each kept as it starts: a failed start leaves none unreaped
                self.workers.append(self.start_worker())
            return f"workers {' '.join(str(w.pid) for w in old)} killed, {len(old)} started"
        i = rng.randrange(len(self.workers))
        w = self.workers[i]
        if kind == "hang-worker":
            w.send_signal(signal.SIGSTOP)
            try:
                time.sleep(hang_s)  # the fault itself: the process is stopped this long
            finally:
                w.send_signal(signal.SIGCONT)
            return f"worker {w.pid} stopped for {hang_s:g} s"
        if kind == "kill-worker":
            w.kill()
        else:
            w.terminate()
        how = "killed" if kind == "kill-worker" else "drained"
        try:
            w.wait(30)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait(10)
            how = "did not exit in 30 s after SIGTERM: killed"
            self.failures.append(f"worker {w.pid} {how}")
        else:
            if kind == "drain-worker":
                how += f" (exit {w.returncode})"
                if w.returncode != 0:
                    self.failures.append(f"worker {w.pid} drained with exit status {w.returncode}")
        self.gone.append(w)
        self.workers[i] = self.start_worker()
        return f"worker {w.pid} {how}, {self.workers[i].pid} started"

    def note_client_exit(self, p: subprocess.Popen) -> None:
        """The client process ends only when told (SIGTERM: 0) or killed; 3: a wrong reply."""
        rc = p.poll()
        if rc == 3:
            self.wrong += 1
        elif rc is not None:
            self.failures.append(f"client process {p.pid} exited by itself with status {rc}")

    def close(self) -> None:
        if self.counts and self.client is not None and self.client.poll() is None:
            # The last instance's word once nothing sends (the threads have stopped): the
            # client process first, so that its calls are all in.
            self.client.terminate()
            try:
                self.client.wait(30)
            except subprocess.TimeoutExpired:
                pass
            self.scrape("close", settle=True)
        # All told at once (SIGTERM): the workers drain and say goodbye to a broker that is
        # still there, since a broker drains too.
        for p in [*self.workers, self.broker]:
            if p is not None and p.poll() is not None:  # ended by itself, mid-run
                self.failures.append(f"{p.args[2]} {p.pid} had exited by itself (status {p.returncode})")
        live = [p for p in [*self.workers, self.broker] if p is not None and p.poll() is None]
        hostile_early = self.hostile is not None and self.hostile.poll() is not None  # it runs until told
        for p in [self.hostile, self.client, *self.workers, self.broker]:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in [self.hostile, self.client, *self.workers, self.broker, *self.gone]:
            if p is None:
                continue
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            if p.stdout is not None:
                if p is self.hostile:
                    self.hostile_report = _last_json(p.stdout.read())
                p.stdout.close()
        for p in live:  # SIGTERM: they drain and exit 0
            if p.returncode != 0:
                self.failures.append(f"{p.args[2]} {p.pid} exited with status {p.returncode} on SIGTERM")
        if self.client is not None:  # SIGTERM: 0, unless it had ended by itself
            if self.client.returncode == 3:
                self.wrong += 1
            elif self.client.returncode != 0:
                self.failures.append(f"client process {self.client.pid} ended with status {self.client.returncode}")
        if self.hostile is not None and (hostile_early or self.hostile.returncode != 0):
            self.failures.append(self._hostile_ended(hostile_early))
        placed = {id(p) for p in [self.hostile, self.client, *self.workers, self.broker, *self.gone]}
        for p in self.spawned:  # started, but an interrupt came before it was kept in its place
            if id(p) not in placed and p.returncode is None:
                p.kill()
                p.wait(10)
            if id(p) not in placed and p.stdout is not None:
                p.stdout.close()
        if self.relay is not None:
            self.relay.close()

    def _hostile_ended(self, early: bool) -> str:
        rc = self.hostile.returncode
        if rc == 4:
            return f"hostile process {self.hostile.pid}: a forged descriptor was served (status 4)"
        try:
            with open(self._hostile_log, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace").strip()
        except OSError:
            tail = ""
        how = "ended by itself" if early else "ended"
        return f"hostile process {self.hostile.pid} {how} with status {rc}" + (f": {tail}" if tail else "")


class Tally:
    """One client's outcomes (a thread or tasks of one loop write it; reads come after)."""

    def __init__(self) -> None:
        self.outcomes: Counter = Counter()
        self.samples: list[str] = []  # the first two error messages of each kind, for the report
        self.latencies: list[float] = []
        self.client_stats: Counter = Counter()  # the clients' own counters, as they closed

    def note_client(self, c) -> None:
        """What a client did beyond its calls: resends (a restart, a replaced connection),
        replies it dropped (late copies), restarts and reconnects it saw."""
        for k in ("resent_calls", "stray_replies", "broker_restarts", "broker_reconnects"):
            self.client_stats[k] += getattr(c, k)

    def done(self, t0: float, ok: bool) -> None:
        self.latencies.append(time.monotonic() - t0)
        self.outcomes["ok" if ok else "wrong"] += 1

    def crashed(self, e: BaseException) -> None:
        """The client itself failed (outside a request: making it, waiting for the service)."""
        self.outcomes["crashed"] += 1
        self.samples.append(f"crashed: {type(e).__name__}: {e}")

    def failed(self, e: BaseException) -> None:
        self.outcomes[type(e).__name__] += 1
        if self.outcomes[type(e).__name__] <= 2:
            self.samples.append(f"{type(e).__name__}: {e}")

    def report(self) -> dict:
        lat = sorted(self.latencies)
        return {"outcomes": dict(self.outcomes),
                "requests": sum(n for k, n in self.outcomes.items() if k != "dropped"),  # answered or failed
                "p50_ms": round(statistics.median(lat) * 1e3, 3) if lat else None,
                "max_ms": round(lat[-1] * 1e3, 1) if lat else None, "error_samples": self.samples,
                "client_stats": dict(self.client_stats)}


def _wait_service(c, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not c.mmi_service("echo", timeout=5):
        if time.monotonic() > deadline:
            raise TimeoutError("no echo worker registered")
        time.sleep(0.05)


def _sync_client(fe: str, kind: str, tally: Tally, stop: threading.Event, timeout: float, seed: int,
                 quiet_s: float = 0.0) -> None:
    from client_sdk import Client

    rng = np.random.default_rng(seed)
    tcp = fe.startswith("tcp://")
    hb = 0.6 if kind == "pipelined" else 1.0
    with Client(fe, timeout=timeout, pin=(kind == "pinned") and not tcp, insecure=tcp, heartbeat_interval=hb) as c:
        _wait_service(c)
        frame = None
        if kind == "frame":  # in the client's shared memory, or (tcp) sent inline
            frame = np.empty((256, 1024), np.uint8) if tcp else c.alloc((256, 1024), np.uint8)
        n = 0
        while not stop.is_set():
            n += 1
            if frame is not None:
                value = n % 251
                frame.fill(value)
                x = frame
            else:
                x = rng.integers(0, 256, 16, dtype=np.uint8)
            t0 = time.monotonic()
            if kind == "pipelined":
                _pipelined(c, x, tally, stop, rng, quiet_s)
                continue
            try:
                with c.infer("echo", {"x": x}) as r:
                    y = r["x"]
                    ok = (y.shape == x.shape and int(y.min()) == value == int(y.max())) if frame is not None \
                        else bool(np.array_equal(y, x))
            except Exception as e:  # every kind of failure is counted, and the load goes on
                tally.failed(e)
                continue
            tally.done(t0, ok)
        tally.note_client(c)


def _stream_client(fe: str, tally: Tally, stop: threading.Event, timeout: float, seed: int) -> None:
    from client_sdk import Client, EndOfStream, InferenceError

    tcp = fe.startswith("tcp://")
    rng = np.random.default_rng(seed)
    sent: dict[int, tuple[np.ndarray, float]] = {}

    def take(r) -> None:
        for f in [f for f in sent if f < r.frame]:  # results come in send order: these were dropped
            del sent[f]
            tally.client_stats["stream_skipped"] += 1
        x, t0 = sent.pop(r.frame)
        try:
            tally.done(t0, bool(np.array_equal(r["x"], x)))
        finally:
            r.release()

    with Client(fe, timeout=timeout, insecure=tcp) as c:
        _wait_service(c)
        with c.stream("echo", latest_wins=True, max_in_flight=2, timeout=timeout) as st:
            while True:
                # Read once a round: the run may stop between a look that found a frame still
                # out (TimeoutError) and a second reading, which took that frame for one still
                # out after the timeout, and never collected it.
                stopping = stop.is_set()
                if not stopping:
                    x = rng.integers(0, 256, 16, dtype=np.uint8)
                    sent[st.send({"x": x})] = (x, time.monotonic())
                while True:  # what has come back
                    try:
                        take(st.recv(timeout=timeout if stopping else 0.0))
                    except EndOfStream:
                        break
                    except InferenceError as e:  # the frame's own error (DeadlineExceeded is a
                        tally.failed(e)          # TimeoutError too: it went uncounted)
                    except TimeoutError as e:
                        if stopping:
                            tally.failed(e)  # a frame still out after the timeout, at the end
                        break
                    except Exception as e:  # the frame's own error
                        tally.failed(e)
                if stopping:
                    break
                stop.wait(0.005)  # the camera's pace (200 fps), not a synchronisation
            tally.outcomes["dropped"] += st.stats()["dropped"]
        tally.note_client(c)


def _pipelined(c, x, tally: Tally, stop: threading.Event, rng, quiet_s: float) -> None:
    """Two requests sent, a quiet spell with no call into the client, both collected (the
    latency counted is the collection's, from the end of the spell)."""
    xs = [x, x[::-1].copy()]
    calls = []
    try:
        for v in xs:
            calls.append(c.infer_stream("echo", {"x": v}))
        stop.wait(float(rng.uniform(0, quiet_s)))  # the program's own work: the scenario
        t0 = time.monotonic()
        for v, call in zip(xs, calls):
            try:
                with call.result() as r:
                    ok = bool(np.array_equal(r["x"], v))
            except Exception as e:
                tally.failed(e)
                continue
            tally.done(t0, ok)
    except Exception as e:  # a send: it and the one after it never went
        for _ in range(len(xs) - len(calls)):
            tally.failed(e)
    finally:
        for call in calls:
            call.close()


def _async_client(fe: str, tally: Tally, stop: threading.Event, timeout: float, seed: int, tasks: int) -> None:
    from client_sdk import AsyncClient

    async def one_task(c, rng) -> None:
        while not stop.is_set():
            x = rng.integers(0, 256, 16, dtype=np.uint8)
            t0 = time.monotonic()
            try:
                r = await c.infer("echo", {"x": x})
                try:
                    ok = bool(np.array_equal(r["x"], x))
                finally:
                    r.release()
            except Exception as e:
                tally.failed(e)
                continue
            tally.done(t0, ok)

    async def main() -> None:
        async with AsyncClient(fe, timeout=timeout, insecure=fe.startswith("tcp://")) as c:
            deadline = time.monotonic() + 60
            while not await c.mmi_service("echo", timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError("no echo worker registered")
                await asyncio.sleep(0.05)
            await asyncio.gather(*(one_task(c, np.random.default_rng(seed + i)) for i in range(tasks)))
            tally.note_client(c)

    asyncio.run(main())


def _counting_crashes(target, tally: Tally, *args) -> None:
    try:
        target(*args)
    except BaseException as e:  # the thread's end: counted, or the run would pass without it
        tally.crashed(e)


def schedule(seconds: float, every: float, seed: int, faults: tuple[str, ...] = FAULTS) -> list[tuple[float, str]]:
    """The faults of a run, (offset in s, kind): one every `every` s, jittered by +-25 %,
    kinds drawn at random but each at least once when the run holds that many."""
    rng = random.Random(seed)
    times, t = [], every
    while t < seconds:
        times.append(t)
        t += every * rng.uniform(0.75, 1.25)
    kinds = list(faults) * (len(times) // len(faults)) + rng.sample(list(faults), len(times) % len(faults))
    rng.shuffle(kinds)
    return list(zip(times, kinds))


def run(seconds: float = 60.0, *, every: float = 3.0, seed: int = 1, workers: int = 3, heartbeat: float = 0.2,
        hang_s: float = 1.5, timeout: float = 30.0, settle_s: float = 3.0, async_tasks: int = 4,
        service_grace: float = 30.0, max_retries: int | None = None, model: str = "echo", tcp: bool = False,
        plan: list[tuple[float, str]] | None = None, clients: tuple[str, ...] = CLIENTS,
        hostile: bool = False, counts: bool = False, log=print) -> dict:
    """One chaos run (see the module docstring); `plan` replaces the random schedule, `model`
    the workers' echo (served as `echo`: any model that returns its input)."""
    unknown = set(clients) - set(CLIENTS)
    if unknown:
        raise ValueError(f"no such client kind: {', '.join(sorted(unknown))} (kinds: {', '.join(CLIENTS)})")
    plan = schedule(seconds, every, seed, TCP_FAULTS if tcp else FAULTS) if plan is None else plan
    shm_before = _shm_files()
    d = tempfile.mkdtemp(prefix="zinf-chaos-")
    max_retries = workers + 1 if max_retries is None else max_retries
    try:
        fleet = Fleet(d, heartbeat, workers, ("--service-grace", str(service_grace), "--max-retries", str(max_retries)),
                      model, tcp, hostile_seed=seed + 7 if hostile else None, counts=counts)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    stop = threading.Event()
    tallies = {name: Tally() for name in clients}
    threads = []
    for i, name in enumerate(clients):
        if name == "stream":
            target, args = _stream_client, (fleet.client_ep, tallies[name], stop, timeout, seed * 100 + i)
        elif name == "async":
            target, args = _async_client, (fleet.client_ep, tallies[name], stop, timeout, seed * 100 + i, async_tasks)
        else:
            target, args = _sync_client, (fleet.client_ep, name, tallies[name], stop, timeout, seed * 100 + i,
                                          PIPELINED_QUIET_S)
        threads.append(threading.Thread(target=_counting_crashes, args=(target, tallies[name], *args),
                                        name=f"chaos-{name}", daemon=True))
    events: list[dict] = []
    rng = random.Random(seed + 1)
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        for at, kind in plan:
            wait = t0 + at - time.monotonic()
            if wait > 0:
                stop.wait(wait)  # the schedule's pace, not a synchronisation
            began = time.monotonic() - t0
            what = fleet.fault(kind, rng, hang_s)
            events.append({"t": round(began, 2), "fault": kind, "what": what})
            log(f"{began:7.2f} s  {kind:15s} {what}")
        stop.wait(settle_s)
    finally:
        stop.set()
        # One deadline for all: a request's timeout, and a margin to close the clients.
        join_by = time.monotonic() + timeout + 30
        for t in threads:
            t.join(max(0.0, join_by - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        process_ok = process_resent = 0
        try:
            fleet.close()
            for f in fleet.client_files:
                try:
                    with open(f, "rb") as fh:
                        got = fh.read().split()
                    if got:
                        process_ok += int(got[0])
                        process_resent += int(got[1])
                except FileNotFoundError:  # it never had a reply
                    pass
        finally:
            shutil.rmtree(d, ignore_errors=True)
    elapsed = time.monotonic() - t0
    shm_left = sorted(_shm_files() - shm_before)
    per_client = {name: tally.report() for name, tally in tallies.items()}
    wrong = fleet.wrong + sum(r["outcomes"].get("wrong", 0) for r in per_client.values())
    failed = sum(n for r in per_client.values() for k, n in r["outcomes"].items() if k not in ("ok", "wrong", "dropped"))
    idle = [name for name, r in per_client.items() if not r["outcomes"].get("ok")]  # never got a reply
    count_check = check_counts(fleet.scrapes, per_client, process_ok, process_resent, events) if counts else None
    return {"seconds": round(elapsed, 1), "seed": seed, "every_s": every, "heartbeat_s": heartbeat, "hang_s": hang_s,
            "timeout_s": timeout, "workers": workers, "tcp": tcp, "hostile": hostile, "service_grace_s": service_grace,
            "max_retries": max_retries, "faults": events, "clients": per_client,
            "wrong": wrong, "failed": failed, "stuck_clients": stuck, "idle_clients": idle,
            "process_failures": fleet.failures, "hostile_report": fleet.hostile_report, "shm_left": shm_left,
            "counts": count_check,
            "passed": wrong == 0 and failed == 0 and not stuck and not idle and not fleet.failures and not shm_left
            and (count_check is None or not count_check["mismatches"])}


def check_counts(scrapes: list[dict], per_client: dict, process_ok: int, process_resent: int,
                 events: list[dict]) -> dict:
    """The brokers' zmq_infer_requests_total for `echo` (summed over instances) against what
    the clients got (see `--counts` in the module docstring)."""
    brokers: Counter = Counter()
    for sc in scrapes:
        brokers.update(sc["outcomes"])
    stats: Counter = Counter()
    for r in per_client.values():
        stats.update(r.get("client_stats", {}))
    clients_ok = sum(r["outcomes"].get("ok", 0) + r["outcomes"].get("wrong", 0) for r in per_client.values()) \
        + process_ok
    mismatches: list[str] = []
    # Each call the clients sent again (a broker restart, a replaced connection) may be
    # counted twice, once by each broker (or connection) that saw it; a latest-wins stream's
    # frame skipped at the client was answered all the same; nothing else may add a count.
    stats["resent_calls"] += process_resent
    resent = stats["resent_calls"]
    errors = {k: n for k, n in brokers.items() if k != "ok"}
    # A killed client process's call in flight: client_gone, or ok when its worker's direct
    # reply went before the death (docs/operations.md: nobody can tell whether it was read).
    kills = sum(1 for e in events if e["fault"] == "kill-client")
    extra = resent + stats["stream_skipped"] + kills
    if brokers["ok"] > clients_ok + extra:
        mismatches.append(f"the brokers counted {brokers['ok']} ok, the clients got {clients_ok}, and sent "
                          f"{resent} again ({stats['stream_skipped']} stream frames skipped, {kills} client(s) killed): "
                          f"{brokers['ok'] - clients_ok - extra} ok too many")
    if sum(errors.values()) > resent + kills:
        mismatches.append(f"the brokers counted {errors} for calls that all succeeded at their clients; "
                          f"{resent} resends and {kills} killed client(s) explain {resent + kills}")
    # A SIGKILLed broker or worker takes with it the counts of its last moments (pinned
    # requests' counts travel in the worker's STATS; what a broker counted after its last
    # scrape): with none, every ok a client got was counted.
    killing = {"restart-broker", "outage", "kill-worker", "kill-workers"} & {e["fault"] for e in events}
    if not killing and brokers["ok"] < clients_ok:
        mismatches.append(f"the brokers counted {brokers['ok']} ok, the clients got {clients_ok}: "
                          f"{clients_ok - brokers['ok']} uncounted")
    return {"uncounted": max(0, clients_ok - brokers["ok"]), "exact": not killing,
            "brokers": dict(brokers), "clients_ok": clients_ok, "process_ok": process_ok,
            "client_stats": dict(stats), "instances": scrapes, "mismatches": mismatches}


def client_process(fe: str, count_file: str | None = None) -> int:
    """`--client FE`: the client that kill-client kills.  Pinned, a 64 KiB input in its shared
    memory refilled every request, READY once the service is there; exits 3 on a wrong reply
    (the harness counts it), 0 on SIGTERM.  Its failed requests are not counted: what it
    tests is what it leaves behind when it dies."""
    from client_sdk import Client

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    tcp = fe.startswith("tcp://")
    with Client(fe, timeout=30, pin=not tcp, insecure=tcp) as c:
        _wait_service(c)
        x = np.empty((64, 1024), np.uint8) if tcp else c.alloc((64, 1024), np.uint8)
        print("READY chaos-client", flush=True)
        n = ok = 0
        fd = os.open(count_file, os.O_WRONLY | os.O_CREAT, 0o600) if count_file else None
        while not stop.is_set():
            n += 1
            value = n % 251
            x.fill(value)
            try:
                with c.infer("echo", {"x": x}) as r:
                    y = r["x"]
                    if not (int(y.min()) == value == int(y.max())):
                        return 3
            except Exception:
                continue
            ok += 1
            if fd is not None:  # its ok replies so far, for --counts (it may be killed at any time)
                os.pwrite(fd, b"%20d %20d" % (ok, c.resent_calls), 0)
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--client"]:
        return client_process(argv[1], argv[2] if len(argv) > 2 else None)
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long faults come (default 60)")
    ap.add_argument("--every", type=float, default=3.0, help="mean seconds between faults (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--heartbeat-interval", type=float, default=0.2, help="broker's and workers' (default 0.2)")
    ap.add_argument("--hang-s", type=float, default=1.5, help="how long hang-worker stops a worker (default 1.5)")
    ap.add_argument("--timeout", type=float, default=30.0, help="each request's timeout in s (default 30)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="load after the last fault (default 3)")
    ap.add_argument("--service-grace", type=float, default=30.0,
                    help="the broker's: longer than a worker takes to start (default 30)")
    ap.add_argument("--max-retries", type=int, default=None,
                    help="the broker's (default: workers + 1; see the module docstring)")
    ap.add_argument("--tcp", action="store_true",
                    help="clients on tcp through a relay that can reset their connections (adds the reset fault)")
    ap.add_argument("--hostile", action="store_true",
                    help="a hostile peer beside the clients (`bench.hostile`): mutated messages, forged "
                         "descriptors, floods, junk on the workers' direct sockets")
    ap.add_argument("--counts", action="store_true",
                    help="scrape each broker instance's /metrics at the end of its life and hold "
                         "zmq_infer_requests_total to what the clients got")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = run(a.seconds, every=a.every, seed=a.seed, workers=a.workers, heartbeat=a.heartbeat_interval,
              hang_s=a.hang_s, timeout=a.timeout, settle_s=a.settle_s, service_grace=a.service_grace,
              max_retries=a.max_retries, tcp=a.tcp, hostile=a.hostile, counts=a.counts)
    for name, r in res["clients"].items():
        print(f"{name:8s} {r['requests']:7d} requests  p50 {r['p50_ms']} ms  longest {r['max_ms']} ms  {r['outcomes']}")
        for s in r["error_samples"]:
            print(f"           {s}")
    if res["hostile_report"] is not None:
        print(f"hostile: {res['hostile_report']}")
    for f in res["process_failures"]:
        print(f"process: {f}")
    if res["counts"] is not None:
        c = res["counts"]
        print(f"counts: brokers {c['brokers']}, clients ok {c['clients_ok']} (client process {c['process_ok']}), "
              f"clients {c['client_stats']}")
        for m in c["mismatches"]:
            print(f"counts: MISMATCH {m}")
    print(f"faults {len(res['faults'])}, wrong {res['wrong']}, failed {res['failed']}, stuck clients "
          f"{res['stuck_clients'] or 'none'}, clients with no reply {res['idle_clients'] or 'none'}, "
          f"shared memory left {res['shm_left'] or 'none'}: "
          f"{'PASS' if res['passed'] else 'FAIL'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    from bench.peers import sigterm_exits

    sigterm_exits()
    sys.exit(main())
