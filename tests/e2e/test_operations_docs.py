"""What docs/operations.md and docs/deploy.md promise an operator, checked against the real
processes where no other test checks it: the command lines' documented defaults in `--help`,
bad values refused in one line with exit 2 before a model loads, signals to a worker still
loading its model, the default endpoints under $XDG_RUNTIME_DIR, the READY lines' fields,
`/v2/models/{service}`'s fields, every metric of the docs' two tables with the type and labels
they give, the files the docs say are made (and their modes) and swept after a crash, and a
broker's exit on SIGINT.  Every wait polls a condition with a deadline.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.children import readline_within

from .conftest import HERE, ROOT, Proc
from .test_metrics import get, until

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _run_all(commands: list[list[str]], timeout: float = 30.0, env: dict | None = None,
             ) -> list[subprocess.CompletedProcess]:
    """Run `python ARGS` for each, side by side (each a few hundred ms of imports), and wait
    for all of them."""
    procs = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(env),
                              cwd=ROOT, stdin=subprocess.DEVNULL) for args in commands]
    done = []
    try:
        for p, args in zip(procs, commands):
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate(timeout=10)
                err += b"\n(killed: still running after the timeout)"
            done.append(subprocess.CompletedProcess(args, p.returncode, out.decode(), err.decode()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return done


# ---------------------------------------------------------------------------- the docs' tables

def _doc_metrics(doc: str) -> dict[str, tuple[str, set[str]]]:
    """{metric name: (type, labels)} from the metrics table of a doc ("| `zmq_infer_...` |
    type, labels | ..."): `_input_seconds` after `zmq_infer_compute_seconds` is short for
    `zmq_infer_input_seconds` (as many trailing words replaced as it has)."""
    out = {}
    for line in (ROOT / "docs" / doc).read_text().splitlines():
        if not line.startswith("| `zmq_infer_"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`([a-z_]+)`", cells[0])
        kind, _, labels = cells[1].partition(":")
        kind = kind.strip().rstrip("s")
        labels = {x.strip() for x in re.split(r"[(;]", labels)[0].split(",") if x.strip()}
        first = names[0]
        for n in names:
            if n.startswith("_"):
                n = "_".join(first.split("_")[: -len(n.strip("_").split("_"))]) + n
            out[n] = (kind, labels)
    assert out, f"no metrics table found in docs/{doc}"
    return out


def test_the_metrics_tables_parse():
    ops = _doc_metrics("operations.md")
    assert ops["zmq_infer_requests_total"] == ("counter", {"service", "outcome"})
    assert ops["zmq_infer_shm_pool_capacity_bytes"] == ("gauge", {"service", "worker"})
    dep = _doc_metrics("deploy.md")
    assert dep["zmq_infer_output_seconds"] == ("histogram", {"service"})
    assert dep["zmq_infer_recalled_total"] == ("counter", {"service"})


# ---------------------------------------------------------------------------- command lines

def test_help_defaults_and_bad_values_as_documented(tmp_path):
    """`--help` states the defaults the docs give (and the code has); a bad value is one line
    naming the flag, exit 2, before the worker loads its model; `max_cost = inf` (no bound,
    the worker's own default) is a pool key the file takes."""
    from broker.config import load_launcher
    from broker.state import Config as SchedulerConfig
    from gpu_worker.worker import WorkerConfig

    # a model that would load would wait here for good (the release file is never made)
    loading = {"LOADING_FILE": str(tmp_path / "loading"), "LOADING_RELEASE": str(tmp_path / "never")}
    be = f"--broker=ipc://{tmp_path}/be.ipc"
    bhelp, whelp, *bad = _run_all([
        ["-m", "broker", "--help"],
        ["-m", "gpu_worker", "--help"],
        ["-m", "gpu_worker", be, "--model", "loading_model:factory", "--health-port", "notaport"],
        ["-m", "gpu_worker", be, "--model", "loading_model:factory", "--health-port", "70000"],
        ["-m", "gpu_worker", be, "--log-level", "LOUD"],
        ["-m", "broker", "--frontend", f"ipc://{tmp_path}/fe.ipc", "--backend", f"ipc://{tmp_path}/be.ipc",
         "--log-format", "xml"],
        ["-m", "broker", "--frontend", f"ipc://{tmp_path}/fe.ipc", "--backend", f"ipc://{tmp_path}/be.ipc",
         "--http", "notaport"],
    ], env=loading)

    # python -m broker --help: README and docs/operations.md's defaults, which are the code's.
    sched = SchedulerConfig.__dataclass_fields__
    assert (sched["heartbeat_interval"].default, sched["heartbeat_liveness"].default, sched["max_queue"].default,
            sched["service_grace"].default, sched["max_retries"].default, sched["max_client_requests"].default,
            sched["max_client_bytes"].default, sched["recall_after"].default) == \
        (1.0, 3, 1024, 1.0, 2, 4096, 512 << 20, 0.005)
    text = " ".join(bhelp.stdout.split())
    assert bhelp.returncode == 0, bhelp.stderr
    for words in ["seconds (default 1.0)", "dead (default 3)", "per service (default 1024)",
                  "of its service (default 1.0)", "WORKER_FAILED (default 2)", "MiB (default 256)",
                  "across services (default 4096)", "unread (default 512)", "(PORT alone: 127.0.0.1)",
                  "(default 5; negative: never)", "WARNING (default)", "--log-format {text,json}"]:
        assert words in text, (words, text)
    # python -m gpu_worker --help: README's worker flags and their defaults.
    wf = WorkerConfig.__dataclass_fields__
    assert (wf["max_batch"].default, wf["max_delay"].default, wf["batching"].default, wf["keep_warm_util"].default,
            wf["drain_grace"].default, wf["done_delay"].default, wf["heartbeat_liveness"].default,
            wf["out_capacity"].default) == (8, 0.002, "latency", 0.6, 30.0, 0.005, 3, 256 << 20)
    text = " ".join(whelp.stdout.split())
    assert whelp.returncode == 0, whelp.stderr
    for words in ["--max-batch MAX_BATCH requests per batch at most (default 8)", "company (default 2)",
                  "latency (default)", "default 0.6", "released them (default 30)", "(default 5;",
                  "0: off (default: 50 on a CUDA device, off on the CPU)", "(default 2*max-batch)",
                  "auto (default: cuda:0 when there is one, else cpu), cpu, cuda or cuda:N", "(default inline,shm)",
                  "(PORT alone: 127.0.0.1", "--no-direct-reply", "--direct-tcp", "--no-link", "--drain-grace-s"]:
        assert words in text, (words, text)

    # Bad values: one line naming the flag, exit 2, at once (a bad --health-port was found only
    # after the model loaded, minutes for a large one, and named the flag twice).
    want = [("--health-port", "--health-port 'notaport': expected [HOST:]PORT"),
            ("--health-port", "--health-port '70000': port 70000 out of range"),
            ("--log-level", "argument --log-level: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, not 'LOUD'"),
            ("--log-format", "argument --log-format: invalid choice: 'xml'"),
            ("--http", "--http 'notaport': expected HOST:PORT or PORT")]
    for r, (flag, words) in zip(bad, want):
        assert r.returncode == 2, (r.args, r.returncode, r.stderr[-600:])
        last = r.stderr.strip().splitlines()[-1]
        assert words in last and "Traceback" not in r.stderr, (r.args, r.stderr[-600:])
        assert last.count(flag) == 1, last
    assert not (tmp_path / "loading").exists()  # neither worker began to load its model

    # A pool's max_cost = inf: what --max-cost takes ("inf: no bound"); the file refused it.
    deploy = tmp_path / "d.toml"
    deploy.write_text("[[pool]]\nmodel = 'echo'\nmax_cost = inf\n")
    pool, = load_launcher(str(deploy)).pools
    args = pool.worker_args(f"ipc://{tmp_path}/be.ipc", heartbeat_interval=1.0, heartbeat_liveness=3, link=())
    assert "--max-cost=inf" in args, args


# ---------------------------------------------------------------------------- signals

def test_a_worker_loading_its_model_ignores_hup_and_usr_and_ends_at_once_on_int(tmp_path):
    """docs/operations.md: the worker logs a WARNING that it ignores SIGHUP, SIGUSR1 and
    SIGUSR2 and carries on.  A worker still loading its model (minutes for a large one) died
    of each at once, with no line; and a Ctrl-C (SIGINT) then was a KeyboardInterrupt
    traceback out of the model's factory.  Now the three are said and ignored from the start,
    and SIGINT ends a loading worker at once, as SIGTERM does: nothing to drain yet."""
    loading = tmp_path / "loading"
    w = Proc(["-m", "gpu_worker", "--broker", f"ipc://{tmp_path}/be.ipc", "--model", "loading_model:factory",
              "--out-capacity-mb", "16"],
             env={"LOADING_FILE": str(loading), "LOADING_RELEASE": str(tmp_path / "never")})
    try:
        until(loading.exists, "the worker loading its model")
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            w.p.send_signal(sig)
            w.wait_log(f"{sig.name} ignored", timeout=WAIT)
            assert w.p.poll() is None, (sig.name, w.p.returncode)
        w.p.send_signal(signal.SIGINT)
        assert w.p.wait(WAIT) == -signal.SIGINT
        assert "Traceback" not in w.stderr(None) and "KeyboardInterrupt" not in w.stderr(None), w.stderr()
    finally:
        w.close()


# ---------------------------------------------------------------------------- a running set

def test_default_endpoints_ready_lines_models_metrics_and_files_as_documented():
    """With $XDG_RUNTIME_DIR set and no endpoints (docs/deploy.md): a broker with `--http 0`
    (PORT alone: 127.0.0.1), a worker with `--health-port 0 --direct`, and a client, all in
    that runtime directory; then the promises about them, a SIGKILLed client's and worker's
    files swept, and the broker's exit 0 on SIGINT."""
    top = Path(tempfile.mkdtemp(prefix="zinf-ops-"))  # short: a socket path holds 107 bytes
    env = {"XDG_RUNTIME_DIR": str(top)}
    run = top / f"zmq-infer-{os.getuid()}"
    procs = []
    try:
        b = Proc(["-m", "broker", "--http", "0", "--heartbeat-interval", "0.2"], env=env)
        procs.append(b)
        line = b.wait_ready()
        assert re.fullmatch(rf"READY frontend=ipc://{run}/frontend\.ipc backend=ipc://{run}/backend\.ipc "
                            r"http=127\.0\.0\.1:\d+", line), line
        w = Proc(["-m", "gpu_worker", "--health-port", "0", "--direct", "--heartbeat-interval", "0.2",
                  "--out-capacity-mb", "16"], env=env)
        procs.append(w)
        line = w.wait_ready()
        pid = w.p.pid
        m = re.fullmatch(rf"READY service=echo pid={pid} device=cpu health=127\.0\.0\.1:\d+ "
                         rf"direct=ipc://({run}/w-{pid}-\d+-[0-9a-f]+\.ipc) link=({run}/w-{pid}-\d+-[0-9a-f]+\.link)",
                         line)
        assert m, line
        direct, link = Path(m[1]), Path(m[2])
        # "mode 0600 in the 0700 runtime directory" (docs/protocol.md section 10)
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
        assert stat.S_IMODE(direct.stat().st_mode) == 0o600 and stat.S_IMODE(link.stat().st_mode) == 0o600

        # A client on this host: its reply socket <runtime dir>/c-<pid>-<start>-<random>.ipc.
        code = ("import sys, numpy as np\nfrom client_sdk import Client\n"
                f"c = Client({b.field('frontend')!r})\n"
                "with c.infer('echo', {'x': np.zeros(4, np.uint8)}, timeout=10) as out:\n"
                "    assert out['x'].shape == (4,)\n"
                "print('served', flush=True)\nsys.stdin.read()\n")
        c = Proc(["-c", code], env=env, stdin=True)
        procs.append(c)
        assert readline_within(c.p.stdout, 30, "the client's served") == b"served\n", c.stderr()
        reply, = [n for n in os.listdir(run) if n.startswith("c-")]
        assert re.fullmatch(rf"c-{c.p.pid}-\d+-[0-9a-f]+\.ipc", reply), reply

        base = "http://" + b.field("http")
        # /v2/models/{service}: the fields docs/operations.md lists.
        status, body = get(base, "/v2/models/echo")
        info = json.loads(body)
        assert status == 200, body
        assert {"name", "ready", "workers", "hosts", "transports", "credit", "in_flight", "queue", "inputs",
                "outputs"} <= set(info), info
        worker, = info["workers"]
        assert {"pid", "host", "transports", "credit", "in_flight", "stopping"} <= set(worker), worker
        assert worker["pid"] == pid and worker["stopping"] is False and info["ready"] is True
        assert set(info["queue"]) == {"urgent", "normal", "background"} and info["inputs"] == []

        # /metrics: every metric of both docs' tables, with their type and labels.
        def scrape() -> dict:
            status, body = get(base, "/metrics")
            assert status == 200
            return {fam.name: (fam.type, {k for s in fam.samples for k in s.labels} - {"le"}, fam.samples)
                    for fam in text_string_to_metric_families(body.decode())}

        def served() -> dict | None:
            # A direct reply is counted when the worker's DONE arrives, and the worker's pool
            # use with its next STATS (its housekeeping): both, before the families are read.
            got = scrape()
            ok = any(s.labels == {"service": "echo", "outcome": "ok"} and s.value == 1
                     for s in got["zmq_infer_requests"][2])
            pool = "zmq_infer_shm_pool_used_bytes" in got and got["zmq_infer_shm_pool_used_bytes"][2]
            return got if ok and pool else None

        families = until(served, "the request counted ok")
        for doc in ("operations.md", "deploy.md"):
            for name, (kind, labels) in _doc_metrics(doc).items():
                family = name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name
                assert family in families, (doc, name, sorted(families))
                got_kind, got_labels, samples = families[family]
                assert got_kind == kind, (doc, name, got_kind)
                if samples:  # (the CUDA ones have none on a CPU worker)
                    assert got_labels == labels, (doc, name, got_labels)
        events = {s.labels["event"] for s in families["zmq_infer_broker_events"][2]}
        assert {"dispatched", "retried", "evicted", "returned", "dropped_late", "worker_deaths", "workers_left",
                "alone", "paused"} <= events, events
        assert {s.labels["worker"] for s in families["zmq_infer_shm_pool_used_bytes"][2]} == \
            {f"{pid}@{worker['host']}"}

        # A SIGKILLed client and worker: the broker's sweep unlinks their files.
        c.kill()
        w.kill()
        until(lambda: not (direct.exists() or link.exists() or (run / reply).exists()),
               f"the dead processes' files swept: {os.listdir(run)}")

        b.p.send_signal(signal.SIGINT)  # "exits 0 on SIGTERM or SIGINT"
        assert b.p.wait(WAIT) == 0, b.stderr()
        assert sorted(os.listdir(run)) == [], os.listdir(run)  # its endpoints unlinked too
    finally:
        for p in reversed(procs):
            p.close()
        shutil.rmtree(top, ignore_errors=True)
