"""Audit harness: start a broker and echo worker(s) from this clone, with the trim
instrumentation (AUDIT_TRIM_LOG; AUDIT_NO_TRIM=1 for the control), sample RSS/CPU."""
import os, sys, time, signal, subprocess, threading, socket, contextlib

PY = "/work/main/.venv/bin/python"
ROOT = "/tmp/audit_trim"


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def proc_stat(pid):
    """(rss bytes, cpu seconds)"""
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * 4096
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        return rss, (int(parts[11]) + int(parts[12])) / tck
    except OSError:
        return -1, -1.0


def minflt(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return int(parts[7])
    except OSError:
        return -1


class Stack:
    def __init__(self, name, trim=True, tcp=False, workers=1, worker_args=(), broker_args=()):
        self.dir = f"{ROOT}/audit/run/{name}"
        os.makedirs(self.dir, exist_ok=True)
        self.trimlog = f"{self.dir}/trims.log"
        if os.path.exists(self.trimlog):
            os.unlink(self.trimlog)
        self.backend = f"ipc://{self.dir}/backend.ipc"
        if tcp:
            self.frontend = f"tcp://127.0.0.1:{free_port()}"
        else:
            self.frontend = f"ipc://{self.dir}/frontend.ipc"
        self.trim = trim
        self.tcp = tcp
        self.nworkers = workers
        self.worker_args = list(worker_args)
        self.broker_args = list(broker_args)
        self.procs = []

    def env(self, role):
        e = dict(os.environ, PYTHONPATH=ROOT, AUDIT_TRIM_LOG=self.trimlog, AUDIT_ROLE=role,
                 XDG_RUNTIME_DIR=self.dir)
        if not self.trim:
            e["AUDIT_NO_TRIM"] = "1"
        else:
            e.pop("AUDIT_NO_TRIM", None)
        return e

    def __enter__(self):
        args = [PY, "-m", "broker", "--frontend", self.frontend, "--backend", self.backend]
        if self.tcp:
            args.append("--insecure")
        args += self.broker_args
        self.broker = subprocess.Popen(args, env=self.env("broker"), stdout=subprocess.PIPE,
                                       stderr=open(f"{self.dir}/broker.err", "w"), text=True, cwd=ROOT)
        self.procs.append(self.broker)
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline:
            line = self.broker.stdout.readline()
            if "READY" in line or not line:
                break
        if "READY" not in line:
            self.__exit__(None, None, None)
            raise RuntimeError(f"broker not ready: {line!r}")
        threading.Thread(target=self.broker.stdout.read, daemon=True).start()
        self.workers = []
        for i in range(self.nworkers):
            w = subprocess.Popen([PY, "-m", "gpu_worker", "--broker", self.backend, "--model", "echo",
                                  *self.worker_args],
                                 env=self.env(f"worker{i}"), stdout=subprocess.DEVNULL,
                                 stderr=open(f"{self.dir}/worker{i}.err", "w"), cwd=ROOT)
            self.workers.append(w)
            self.procs.append(w)
        self.wait_ready()
        return self

    def wait_ready(self):
        import numpy as np
        from client_sdk import Client
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                kw = {"insecure": True} if self.tcp else {}
                with Client(self.frontend, timeout=2.0, **kw) as c:
                    c.infer("echo", {"x": np.zeros(4, np.float32)}, timeout=2.0)
                time.sleep(1.5)  # let the workers' warm-up settle
                return
            except Exception:
                time.sleep(0.3)
        raise RuntimeError("worker not ready")

    def pids(self):
        return {"broker": self.broker.pid, **{f"worker{i}": w.pid for i, w in enumerate(self.workers)}}

    def trims(self):
        out = []
        if os.path.exists(self.trimlog):
            for ln in open(self.trimlog):
                pid, role, t0, t1, off, r0, r1 = ln.split()
                out.append(dict(role=role, t0=float(t0), t1=float(t1), off=int(off), rss0=int(r0), rss1=int(r1)))
        return out

    def __exit__(self, *exc):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill(); p.wait(timeout=5)


class Sampler(threading.Thread):
    """RSS/CPU of pids every `every` s."""
    def __init__(self, pids, every=0.25):
        super().__init__(daemon=True)
        self.pids, self.every, self.rows, self.stop_ev = pids, every, [], threading.Event()

    def run(self):
        while not self.stop_ev.is_set():
            t = time.monotonic()
            self.rows.append((t, {k: proc_stat(p) for k, p in self.pids.items()}))
            self.stop_ev.wait(self.every)

    def stop(self):
        self.stop_ev.set(); self.join(timeout=5)


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]
