"""Rolling-restart / broker-restart audit harness (AR stream at ~30 fps, 640x480x3 uint8).

usage: PYTHONPATH=<repo>:<this dir> python roll.py --client stream|astream|pin|apin
         --event roll|roll-new-first|broker-term|broker-kill|none [--secs 10] [--lw 0|1]
         [--timeout 2.0] [--delay-ms 10] [--hb 1.0] [--json out.json]
Starts a broker + 2 workers (--direct) on ipc endpoints in a temp dir, streams frames, does
the operator event(s), and prints counts of lost / duplicated / wrong / out-of-order frames,
errors by type, and the worst stall (max gap between results, max frame latency) per event."""
import argparse, asyncio, collections, json, os, select, shutil, signal, subprocess, sys, tempfile, threading, time
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
ap = argparse.ArgumentParser()
ap.add_argument("--client", default="stream")
ap.add_argument("--event", default="roll")
ap.add_argument("--secs", type=float, default=10.0)
ap.add_argument("--lw", type=int, default=0)
ap.add_argument("--mif", type=int, default=2)
ap.add_argument("--timeout", type=float, default=2.0)
ap.add_argument("--delay-ms", default="10")
ap.add_argument("--hb", default=None, help="broker --heartbeat-interval (default: broker default)")
ap.add_argument("--fps", type=float, default=30.0)
ap.add_argument("--workers", type=int, default=2)
ap.add_argument("--json", default=None)
ap.add_argument("--hold", type=int, default=0, help="keep the last N results unreleased (display double-buffer); re-verify them at release")
ap.add_argument("--alloc", action="store_true", help="stream: frames in client.alloc ring buffers (docs recipe)")
ap.add_argument("--pin", default="default", help="stream(pin=...): default|true|false")
ap.add_argument("--launcher", action="store_true", help="broker + pool of --workers via python -m broker --config")
ap.add_argument("--down", type=float, default=0.0, help="seconds the broker stays down before the restart")
ap.add_argument("--worker-args", default="")
A = ap.parse_args()

tmp = tempfile.mkdtemp(prefix="roll-")
FE, BE = f"ipc://{tmp}/fe.ipc", f"ipc://{tmp}/be.ipc"
ENV = dict(os.environ, XDG_RUNTIME_DIR=tmp, PYTHONUNBUFFERED="1", ROLL_DELAY_MS=A.delay_ms,
           PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
os.environ["XDG_RUNTIME_DIR"] = tmp
procs = []
T0 = None
events = []  # (t, name)

def now():
    return time.monotonic() - T0 if T0 else 0.0

def start(args, name):
    log = open(f"{tmp}/{name}.err", "wb")
    p = subprocess.Popen([PY, *args], stdout=subprocess.PIPE, stderr=log, env=ENV, cwd=HERE)
    p.name = name; p.log = f"{tmp}/{name}.err"
    procs.append(p)
    deadline = time.monotonic() + 30
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{name} not READY")
        r, _, _ = select.select([p.stdout], [], [], left)
        if r:
            c = os.read(p.stdout.fileno(), 4096)
            if not c:
                raise RuntimeError(f"{name} exited {p.wait(5)}: {open(p.log).read()[-2000:]}")
            buf += c
    return p

def broker(name="broker"):
    hb = ["--heartbeat-interval", A.hb] if A.hb else []
    return start(["-m", "broker", "--frontend", FE, "--backend", BE, *hb], name)

def worker(name):
    return start(["-m", "gpu_worker", "--broker", BE, "--model", "roll_model:factory", "--direct",
                  "--out-capacity-mb", "64", *A.worker_args.split()], name)

def mark(name):
    events.append((now(), name)); print(f"[{now():7.3f}] {name}", flush=True)

def wait_exit(p, t=20):
    try:
        return p.wait(t)
    except subprocess.TimeoutExpired:
        return "TIMEOUT"

# ------------------------------------------------------------- client side
H, W = 480, 640
def frame_of(i):
    img = np.full((H, W, 3), i % 251, np.uint8)
    img[0, 0, 0] = i & 0xFF; img[0, 0, 1] = (i >> 8) & 0xFF
    return {"image": img, "fid": np.array([i], np.int64)}

R = dict(sent=0, results=[], errors=[], wrong=0, dup=0, ooo=0, seen=set(), pids=collections.Counter(),
         t_send={}, arrivals=[], lat=[], stats=None, extra={})
stop_flag = threading.Event()
HELD = collections.deque()

def check(r, expect_frame=None, t=None):
    t = now() if t is None else t
    fid = int(r["fid"][0])
    ok = np.array_equal(np.asarray(r["image"]), 255 - frame_of(fid)["image"])
    if expect_frame is not None and expect_frame != fid:
        ok = False
    if not ok:
        R["wrong"] += 1
    if fid in R["seen"]:
        R["dup"] += 1
    if R["results"] and fid < R["results"][-1]:
        R["ooo"] += 1
    R["seen"].add(fid)
    R["results"].append(fid)
    R["pids"][int(r["pid"][0, 0] if r["pid"].ndim > 1 else r["pid"][0])] += 1
    R["arrivals"].append(t)
    R["lat"].append((R["t_send"].get(fid, t), t - R["t_send"].get(fid, t)))
    if A.hold:
        HELD.append((fid, r))
        while len(HELD) > A.hold:
            f0, r0 = HELD.popleft()
            if not np.array_equal(np.asarray(r0["image"]), 255 - frame_of(f0)["image"]):
                R["wrong_held"] = R.get("wrong_held", 0) + 1
            r0.release()
    else:
        r.release()

def err(e, t=None):
    t = now() if t is None else t
    R["errors"].append((t, type(e).__name__, str(e)[:300]))
    R["arrivals"].append(t)

def run_stream():
    from client_sdk import Client, DeadlineExceeded, EndOfStream
    with Client(FE, timeout=A.timeout) as c:
        pin = dict(default=None, true=True, false=False)[A.pin]
        s = c.stream("roll", latest_wins=bool(A.lw), max_in_flight=A.mif, pin=pin)
        ring = [c.alloc((H, W, 3), np.uint8) for _ in range(s.max_in_flight + 2)] if A.alloc else None
        last = [None] * (len(ring) if ring else 0)
        period = 1.0 / A.fps
        nxt = time.monotonic()
        i = 0
        while not stop_flag.is_set():
            f = frame_of(i)
            if ring is not None:
                busy = s.unfinished()
                k = next(k for k, fr in enumerate(last) if fr not in busy)
                ring[k][...] = f["image"]; f = {"image": ring[k], "fid": f["fid"]}; last[k] = i
            n = s.send(f)
            assert n == i, (n, i)
            R["t_send"][i] = now(); R["sent"] += 1; i += 1
            nxt += period
            while True:
                left = nxt - time.monotonic()
                if left <= 0:
                    break
                try:
                    r = s.recv(timeout=left)
                    assert r.frame == int(r["fid"][0]), (r.frame, int(r["fid"][0]))
                    check(r)
                except DeadlineExceeded as e:
                    err(e)
                except EndOfStream:
                    time.sleep(max(0, nxt - time.monotonic())); break
                except TimeoutError:
                    break
                except Exception as e:
                    err(e)
        end = time.monotonic() + A.timeout + 5
        while time.monotonic() < end:
            try:
                r = s.recv(timeout=max(0.01, end - time.monotonic()))
                check(r)
            except EndOfStream:
                break
            except Exception as e:
                if type(e).__name__ == "TimeoutError":
                    R["extra"]["drain_timeout"] = True; break
                err(e)
        st = s.stats(); R["stats"] = {k: getattr(st, k) for k in ("sent","completed","failed","dropped","in_flight","pending","cancelled","expired")}
        s.close()
        R["extra"].update(pinned_replies=c.pinned_replies, broker_restarts=c.broker_restarts,
                          broker_reconnects=getattr(c, "broker_reconnects", None))

def run_pin():
    from client_sdk import Client
    with Client(FE, timeout=A.timeout, pin=True) as c:
        period = 1.0 / A.fps
        nxt = time.monotonic(); i = 0
        while not stop_flag.is_set():
            f = frame_of(i)
            R["t_send"][i] = now(); R["sent"] += 1
            try:
                with c.infer("roll", f) as r:
                    check(r, expect_frame=i)
            except Exception as e:
                err(e)
            i += 1
            nxt += period
            time.sleep(max(0, nxt - time.monotonic()))
        R["extra"].update(pinned_replies=c.pinned_replies, broker_restarts=c.broker_restarts,
                          broker_reconnects=getattr(c, "broker_reconnects", None))

def run_apin():
    from client_sdk import AsyncClient
    async def main():
        async with AsyncClient(FE, timeout=A.timeout, pin=True) as c:
            period = 1.0 / A.fps
            tasks = []
            async def one(i):
                f = frame_of(i)
                R["t_send"][i] = now(); R["sent"] += 1
                try:
                    r = await c.infer("roll", f)
                    check(r, expect_frame=i)
                except Exception as e:
                    err(e)
            nxt = time.monotonic(); i = 0
            while not stop_flag.is_set():
                tasks.append(asyncio.ensure_future(one(i))); i += 1
                nxt += period
                await asyncio.sleep(max(0, nxt - time.monotonic()))
            await asyncio.wait_for(asyncio.gather(*tasks), A.timeout + 10)
            R["extra"].update(pinned_replies=c.pinned_replies, broker_restarts=c.broker_restarts,
                              broker_reconnects=getattr(c, "broker_reconnects", None))
    asyncio.run(main())

def run_astream():
    from client_sdk import AsyncClient, DeadlineExceeded, EndOfStream
    async def main():
        async with AsyncClient(FE, timeout=A.timeout) as c:
            s = c.stream("roll", latest_wins=bool(A.lw), max_in_flight=A.mif)
            async def reader():
                while True:
                    try:
                        r = await s.recv()
                        check(r)
                    except EndOfStream:
                        return
                    except Exception as e:
                        err(e)
            rt = asyncio.ensure_future(reader())
            period = 1.0 / A.fps; nxt = time.monotonic(); i = 0
            while not stop_flag.is_set():
                n = s.send(frame_of(i)); assert n == i
                R["t_send"][i] = now(); R["sent"] += 1; i += 1
                nxt += period
                await asyncio.sleep(max(0, nxt - time.monotonic()))
            s.finish()
            try:
                await asyncio.wait_for(rt, A.timeout + 5)
            except asyncio.TimeoutError:
                R["extra"]["drain_timeout"] = True
            st = s.stats(); R["stats"] = {k: getattr(st, k) for k in ("sent","completed","failed","dropped","in_flight","pending","cancelled","expired")}
            s.close()
            R["extra"].update(pinned_replies=c.pinned_replies, broker_restarts=c.broker_restarts,
                              broker_reconnects=getattr(c, "broker_reconnects", None))
    asyncio.run(main())

# ------------------------------------------------------------- orchestration
shm_before = set(os.listdir("/dev/shm"))
rc = 0
try:
    if A.launcher:
        with open(f"{tmp}/deploy.toml", "w") as f:
            f.write(f'[launcher]\ndrain_timeout_s = 10\n[[pool]]\nmodel = "roll_model:factory"\ncount = {A.workers}\n'
                    f'device = "cpu"\nextra_args = ["--direct", "--out-capacity-mb", "64"]\n')
        def broker(name="launcher"):
            return start(["-m", "broker", "--config", f"{tmp}/deploy.toml", "--frontend", FE, "--backend", BE,
                          "--log-level", "INFO"], name)
        b = broker(); ws = []
    else:
        b = broker()
        ws = [worker(f"w{k}") for k in range(A.workers)]
    T0 = time.monotonic()
    target = dict(stream=run_stream, pin=run_pin, apin=run_apin, astream=run_astream)[A.client]
    client_exc = []
    def guarded():
        try:
            target()
        except BaseException as e:
            import traceback; client_exc.append(traceback.format_exc())
    th = threading.Thread(target=guarded, daemon=True); th.start()
    time.sleep(2.0)
    def pinned_pid():
        c = collections.Counter(R["pids"]); return c.most_common(1)[0][0] if c else None
    if A.event in ("roll", "roll-new-first"):
        for k in range(len(ws)):
            # kill the worker that served most of the last results first (the leaseholder)
            recent = collections.Counter()
            # map last 10 results' pids
            order = sorted(range(len(ws)), key=lambda j: -R["pids"].get(ws[j].pid, 0)) if k == 0 else [j for j in range(len(ws)) if not getattr(ws[j], "rolled", False)]
            j = [x for x in order if not getattr(ws[x], "rolled", False)][0]
            old = ws[j]
            if A.event == "roll":
                mark(f"SIGTERM {old.name} pid={old.pid}"); old.send_signal(signal.SIGTERM)
                st = wait_exit(old); mark(f"{old.name} exited {st}")
                nw = worker(old.name + "n"); mark(f"{nw.name} READY pid={nw.pid}")
            else:
                nw = worker(old.name + "n"); mark(f"{nw.name} READY pid={nw.pid}")
                mark(f"SIGTERM {old.name} pid={old.pid}"); old.send_signal(signal.SIGTERM)
                st = wait_exit(old); mark(f"{old.name} exited {st}")
            nw.rolled = True
            ws[j] = nw
            time.sleep(2.0)
    elif A.event == "roll-fast":
        # SIGTERM w_k and start its replacement at once (no wait for the exit); next worker as soon as READY
        olds = list(ws)
        for k, old in enumerate(olds):
            mark(f"SIGTERM {old.name} pid={old.pid}"); old.send_signal(signal.SIGTERM)
            nw = worker(old.name + "n"); mark(f"{nw.name} READY pid={nw.pid}"); ws[k] = nw
        for old in olds:
            st = wait_exit(old); mark(f"{old.name} exited {st}")
        time.sleep(2.0)
    elif A.event == "hup":
        for k in range(2):
            n0 = open(b.log, errors="replace").read().count("rolling restart done")
            mark("SIGHUP launcher"); b.send_signal(signal.SIGHUP)
            end = time.monotonic() + 40
            while open(b.log, errors="replace").read().count("rolling restart done") <= n0 and time.monotonic() < end:
                time.sleep(0.05)
            mark("roll done" if time.monotonic() < end else "roll NOT done in 40 s")
            time.sleep(1.5)
    elif A.event == "broker-term":
        mark("SIGTERM broker"); b.send_signal(signal.SIGTERM); st = wait_exit(b); mark(f"broker exited {st}"); time.sleep(A.down)
        b = broker("broker2"); mark("broker2 READY"); time.sleep(3.0)
    elif A.event == "broker-kill":
        mark("SIGKILL broker"); b.kill(); st = wait_exit(b); mark(f"broker exited {st}"); time.sleep(A.down)
        b = broker("broker2"); mark("broker2 READY"); time.sleep(3.0)
    elif A.event == "none":
        pass
    rest = A.secs - now()
    if rest > 0:
        time.sleep(rest)
    stop_flag.set()
    th.join(A.timeout + 30)
    if th.is_alive():
        print("CLIENT THREAD STUCK"); rc = 3
    if client_exc:
        print("CLIENT EXCEPTION:", client_exc[0]); rc = 4
finally:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in reversed(procs):
        if wait_exit(p, 15) == "TIMEOUT":
            p.kill(); p.wait(5)
    logs = {p.name: open(p.log, errors="replace").read()[-1500:] for p in procs}
    shm_after = set(os.listdir("/dev/shm"))
    shutil.rmtree(tmp, ignore_errors=True)

# ------------------------------------------------------------- report
sent = R["sent"]; got = len(R["seen"])
errs = collections.Counter(e[1] for e in R["errors"])
arr = sorted(R["arrivals"])
def worst_gap(t0, t1):
    xs = [t for t in arr if t0 <= t <= t1]
    if len(xs) < 2:
        return None
    g = max((b - a, a) for a, b in zip(xs, xs[1:]))
    return round(g[0] * 1000, 1), round(g[1], 3)
def worst_lat(t0, t1):
    xs = [(l, s) for s, l in R["lat"] if t0 <= s <= t1]
    return (round(max(xs)[0] * 1000, 1), round(max(xs)[1], 3)) if xs else None
ev = [e for e in events if e[1].startswith("SIG")]
out = dict(wrong_held=R.get("wrong_held", 0), client=A.client, event=A.event, lw=A.lw, sent=sent, results=len(R["results"]), unique=got,
           errors=dict(errs), wrong=R["wrong"], dup=R["dup"], out_of_order=R["ooo"],
           unaccounted=sent - got - len(R["errors"]),
           baseline_gap_ms=worst_gap(0.5, 1.9), baseline_lat_ms=worst_lat(0.5, 1.9),
           per_event=[dict(t=round(t, 3), ev=n, worst_gap_ms_at=worst_gap(t - 0.2, t + 4), worst_lat_ms_at=worst_lat(t - 0.2, t + 4)) for t, n in ev],
           pids=dict(R["pids"]), stats=R["stats"], extra=R["extra"],
           shm_leak=sorted(shm_after - shm_before), events=[(round(t, 3), n) for t, n in events],
           error_samples=[(round(t, 3), n, m) for t, n, m in R["errors"][:6]])
if os.environ.get("ROLL_BRIEF"):
    print("SUMMARY", json.dumps({k: out[k] for k in ("wrong_held","client","event","lw","sent","unique","errors","wrong","dup","out_of_order","unaccounted","baseline_gap_ms","stats","extra","shm_leak")}))
    for pe in out["per_event"]: print("  EVENT", json.dumps(pe))
    for e in out["error_samples"]: print("  ERR", e)
    print("  EVENTS", out["events"])
    slow = sorted(((l, s0, fid) for fid, (s0, l) in zip(R["results"], R["lat"]) ), reverse=True)[:5]
    print("  SLOWEST(lat_ms, sent_at, fid)", [(round(l*1000,1), round(s0,3), f) for l, s0, f in slow])
else:
    print(json.dumps(out, indent=1))
if A.json:
    json.dump(dict(out, logs=logs), open(A.json, "w"), indent=1)
if os.environ.get("ROLL_LOGS"):
    for k, v in logs.items():
        print(f"--- {k} ---\n{v}")
sys.exit(rc)
