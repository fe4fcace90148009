"""Reports: JSON schema, skipped peers kept with their reason, ratios, markdown, plots, and
the command line end to end (in-process with fake peers, and as a subprocess with real ones)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from bench import __main__ as cli
from bench.peers import PEERS, Peer, PeerClient
from bench.report import RATIOS, compute_ratios

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULT_KEYS = {
    "peer", "workload", "payload_bytes", "payload_label", "payload_shape", "mode", "concurrency",
    "rate_rps", "arrival", "requests", "errors", "timeouts", "error_samples", "measured_s",
    "throughput_rps", "throughput_MBps", "latency_ms", "slo_ms", "slo_attainment", "server_ms",
    "server_samples", "windows", "window_p50_ms", "converged", "max_send_lag_ms", "hdr",
}
TOP_KEYS = {"schema", "command", "argv", "command_line", "started_at", "wall_s", "machine",
            "config", "peers", "skipped", "results"}
MACHINE_KEYS = {"cpu_model", "cores", "python", "pyzmq", "libzmq"}


class SleepClient(PeerClient):
    def __init__(self, base_ms: float, per_mb_ms: float, timing: bool):
        self.base_ms, self.per_mb_ms, self.timing = base_ms, per_mb_ms, timing

    async def request(self, payload):
        n = payload.nbytes if hasattr(payload, "nbytes") else len(payload)
        await asyncio.sleep((self.base_ms + self.per_mb_ms * n / 1e6) / 1000)
        if self.timing:
            return {"queue_ms": 0.1, "input_ms": 0.2, "compute_ms": 0.3, "output_ms": 0.4}
        return None


def fake_peer(peer_name: str, base_ms: float = 1.0, per_mb_ms: float = 0.0,
              timing: bool = False, ok: bool = True):
    class Fake(Peer):
        name = peer_name
        description = f"in-process fake ({base_ms} ms + {per_mb_ms} ms/MB)"

        def available(self):
            return (True, "") if ok else (False, f"{peer_name} is switched off for this test")

        def start(self):
            pass

        def client(self):
            return SleepClient(base_ms, per_mb_ms, timing)

    return Fake


FAST = ["--window-s", "0.04", "--warmup-s", "0", "--max-duration-s", "0.25", "--quiet"]


def test_compare_report_schema_skips_and_outputs(tmp_path, monkeypatch):
    monkeypatch.setitem(PEERS, "fake-a", fake_peer("fake-a", 1.0, timing=True))
    monkeypatch.setitem(PEERS, "fake-b", fake_peer("fake-b", 3.0))
    monkeypatch.setitem(PEERS, "fake-off", fake_peer("fake-off", ok=False))
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    plots = tmp_path / "plots"
    rc = cli.main(["compare", "--peers", "fake-a,fake-off,fake-b,nonexistent", "--sizes", "16,4k",
                   "--slo-ms", "2", "--json", str(out), "--markdown", str(md),
                   "--plots", str(plots), *FAST])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert TOP_KEYS <= set(rep) and {"ratios", "ratios_missing"} <= set(rep)
    assert MACHINE_KEYS <= set(rep["machine"])
    assert rep["schema"] == "zinf-bench/1" and rep["command"] == "compare"
    assert "compare" in rep["command_line"] and "--sizes" in rep["argv"]
    # Unavailable peers are listed with their reasons, in the order asked for.
    assert list(rep["peers"]) == ["fake-a", "fake-off", "fake-b", "nonexistent"]
    assert rep["peers"]["fake-off"] == {
        "status": "skipped", "reason": "fake-off is switched off for this test",
        "description": PEERS["fake-off"].description}
    skipped = {s["peer"]: s["reason"] for s in rep["skipped"]}
    assert set(skipped) == {"fake-off", "nonexistent"}
    assert "unknown peer" in skipped["nonexistent"]

    assert len(rep["results"]) == 4  # 2 peers x 2 sizes
    for r in rep["results"]:
        assert set(r) == RESULT_KEYS
        assert r["requests"] > 0 and r["errors"] == 0
        assert set(r["latency_ms"]) >= {"p50", "p90", "p95", "p99", "p99.9", "max"}
        assert r["latency_ms"]["p50"] <= r["latency_ms"]["p99"] <= r["latency_ms"]["max"]
        assert 0.0 <= r["slo_attainment"] <= 1.0
    a = next(r for r in rep["results"] if r["peer"] == "fake-a")
    b = next(r for r in rep["results"] if r["peer"] == "fake-b")
    assert a["server_ms"] == {"queue": 0.1, "input": 0.2, "compute": 0.3, "output": 0.4}
    assert b["server_ms"] is None
    assert a["slo_attainment"] > 0.5 and b["slo_attainment"] < 0.5  # 2 ms SLO: 1 ms vs 3 ms
    # None of the ratios' peers in this run: every ratio is null and names a missing peer.
    assert set(rep["ratios"]) == set(RATIOS) and all(v is None for v in rep["ratios"].values())
    for k, ((num, _), (den, _), _) in RATIOS.items():
        assert f"peer {num!r} was not part of this run" in rep["ratios_missing"][k]

    text = md.read_text()
    assert "| peer |" in text and "fake-a" in text and "fake-off" in text
    pngs = sorted(os.listdir(plots))
    assert {"latency_vs_size.png", "throughput_vs_p99.png", "cdf_16B_c1.png", "cdf_4KiB_c1.png"} <= set(pngs)
    assert all(os.path.getsize(plots / f) > 1000 for f in pngs)

    # The saved JSON is enough to redraw everything.
    md2, plots2 = tmp_path / "again.md", tmp_path / "again"
    assert cli.main(["render", str(out), "--markdown", str(md2), "--plots", str(plots2), "--quiet"]) == 0
    assert md2.read_text().splitlines()[6:] == text.splitlines()[6:]
    assert set(os.listdir(plots2)) == set(pngs)


def test_ratios_from_a_run_with_all_their_peers(tmp_path, monkeypatch):
    # Timing-based: retried (a multi-millisecond preemption of this process on a shared 2-core
    # CI box can spoil one run; a harness bug fails every attempt).
    for attempt in range(3):
        try:
            return _check_ratios_run(tmp_path / str(attempt), monkeypatch)
        except AssertionError:
            if attempt == 2:
                raise


def _check_ratios_run(tmp_path, monkeypatch):
    # A payload-independent "broker", floors that are faster at 16 B, a gRPC that pays per MB.
    monkeypatch.setitem(PEERS, "broker-shm", fake_peer("broker-shm", 4.0))
    monkeypatch.setitem(PEERS, "proxy-sdk", fake_peer("proxy-sdk", 3.0))
    monkeypatch.setitem(PEERS, "proxy", fake_peer("proxy", 2.0))
    monkeypatch.setitem(PEERS, "direct", fake_peer("direct", 1.0))
    monkeypatch.setitem(PEERS, "grpc", fake_peer("grpc", 4.0, per_mb_ms=2.0))
    monkeypatch.setitem(PEERS, "pinned", fake_peer("pinned", 3.5))
    monkeypatch.setitem(PEERS, "pinned-ipc", fake_peer("pinned-ipc", 5.0))
    out = tmp_path / "q.json"  # main() creates the folder
    rc = cli.main(["quick", "--peers", "broker-shm,proxy-sdk,proxy,direct,grpc,pinned,pinned-ipc", "--json", str(out),
                   *FAST])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["ratios_missing"] == {}
    r = rep["ratios"]

    def p50(peer, nbytes):
        (row,) = [x for x in rep["results"] if x["peer"] == peer and x["payload_bytes"] == nbytes]
        return row["latency_ms"]["p50"]

    frame, big = 1080 * 1920 * 3, 64 << 20
    # Each ratio is exactly the quotient of the p50s it names ...
    assert r["broker_vs_proxy_floor_tiny"] == pytest.approx(p50("broker-shm", 16) / p50("proxy-sdk", 16), rel=1e-3)
    assert r["pinned_vs_direct_tiny"] == pytest.approx(p50("pinned", 16) / p50("direct", 16), rel=1e-3)
    assert r["pinned_vs_grpc_tiny"] == pytest.approx(p50("pinned", 16) / p50("grpc", 16), rel=1e-3)
    assert r["pinned_link_vs_ipc_tiny"] == pytest.approx(p50("pinned", 16) / p50("pinned-ipc", 16), rel=1e-3)
    assert r["pinned_payload_independence_6mb"] == pytest.approx(p50("pinned", frame) / p50("pinned", 16), rel=1e-3)
    assert r["broker_vs_bare_proxy_tiny"] == pytest.approx(p50("broker-shm", 16) / p50("proxy", 16), rel=1e-3)
    assert r["proxy_sdk_vs_proxy_tiny"] == pytest.approx(p50("proxy-sdk", 16) / p50("proxy", 16), rel=1e-3)
    assert r["broker_vs_direct_tiny"] == pytest.approx(p50("broker-shm", 16) / p50("direct", 16), rel=1e-3)
    assert r["payload_independence_6mb"] == pytest.approx(p50("broker-shm", frame) / p50("broker-shm", 16), rel=1e-3)
    assert r["payload_independence_64mb"] == pytest.approx(p50("broker-shm", big) / p50("broker-shm", 16), rel=1e-3)
    assert r["grpc_vs_shm_6mb"] == pytest.approx(p50("grpc", frame) / p50("broker-shm", frame), rel=1e-3)
    # ... and sees the fakes' shapes (loosely: sleeps overshoot on a busy machine).
    assert r["broker_vs_direct_tiny"] > r["broker_vs_bare_proxy_tiny"] > r["broker_vs_proxy_floor_tiny"] > 1.0
    assert r["proxy_sdk_vs_proxy_tiny"] > 1.0
    assert 0.5 < r["payload_independence_6mb"] < 2.0
    assert 0.5 < r["payload_independence_64mb"] < 2.0
    assert r["grpc_vs_shm_6mb"] > 1.5  # (4 + 12.4) / 4 nominally


def _row(peer, nbytes, p50, conc=1):
    return {"peer": peer, "payload_bytes": nbytes, "mode": "closed", "concurrency": conc,
            "latency_ms": {"p50": p50}}


def test_compute_ratios_exact_and_missing_reasons():
    ok = {"status": "ok", "reason": ""}
    peers = {"broker-shm": ok, "proxy-sdk": ok, "proxy": ok, "direct": ok,
             "grpc": {"status": "failed", "reason": "start failed: port in use"}}
    rows = [_row("broker-shm", 16, 0.3), _row("broker-shm", 16, 9.9, conc=8),
            _row("proxy-sdk", 16, 0.25), _row("proxy", 16, 0.2), _row("direct", 16, 0.1),
            _row("broker-shm", 6_220_800, 0.6)]
    ratios, missing = compute_ratios(rows, peers)
    assert ratios["broker_vs_proxy_floor_tiny"] == pytest.approx(1.2)  # lowest concurrency used
    assert ratios["broker_vs_bare_proxy_tiny"] == pytest.approx(1.5)
    assert ratios["proxy_sdk_vs_proxy_tiny"] == pytest.approx(1.25)
    assert ratios["broker_vs_direct_tiny"] == pytest.approx(3.0)
    assert ratios["payload_independence_6mb"] == pytest.approx(2.0)
    assert ratios["payload_independence_64mb"] is None
    assert "not measured at 67108864 B" in missing["payload_independence_64mb"]
    assert ratios["grpc_vs_shm_6mb"] is None
    assert "port in use" in missing["grpc_vs_shm_6mb"]
    pinned = {"pinned_vs_direct_tiny", "pinned_vs_grpc_tiny", "pinned_payload_independence_6mb",
              "pinned_payload_independence_64mb", "pinned_link_vs_ipc_tiny"}  # no pinned peer in this run
    assert set(ratios) == set(RATIOS) and set(missing) == {"payload_independence_64mb", "grpc_vs_shm_6mb"} | pinned


def test_broker_floor_ratio_needs_the_sdk_floor_not_the_bare_proxy():
    ok = {"status": "ok", "reason": ""}
    rows = [_row("broker-shm", 16, 0.3), _row("proxy", 16, 0.2), _row("direct", 16, 0.1)]
    ratios, missing = compute_ratios(rows, {"broker-shm": ok, "proxy": ok, "direct": ok})
    # Without proxy-sdk the floor ratio is null (never silently the bare proxy's) ...
    assert ratios["broker_vs_proxy_floor_tiny"] is None
    assert "peer 'proxy-sdk' was not part of this run" in missing["broker_vs_proxy_floor_tiny"]
    assert ratios["proxy_sdk_vs_proxy_tiny"] is None
    # ... while the bare-floor and direct ratios still come out.
    assert ratios["broker_vs_bare_proxy_tiny"] == pytest.approx(1.5)
    assert ratios["broker_vs_direct_tiny"] == pytest.approx(3.0)
    # A proxy-sdk that failed to start says so.
    failed = {"status": "failed", "reason": "start failed: no READY"}
    ratios, missing = compute_ratios(rows, {"broker-shm": ok, "proxy": ok, "proxy-sdk": failed})
    assert ratios["broker_vs_proxy_floor_tiny"] is None
    assert "no READY" in missing["broker_vs_proxy_floor_tiny"]


def test_rate_subcommand_open_loop(tmp_path, monkeypatch):
    monkeypatch.setitem(PEERS, "fake-a", fake_peer("fake-a", 1.0))
    out = tmp_path / "rate.json"
    rc = cli.main(["rate", "--peers", "fake-a", "--rate", "300", "--arrival", "poisson",
                   "--json", str(out), *FAST])
    assert rc == 0
    rep = json.loads(out.read_text())
    (r,) = rep["results"]
    assert r["mode"] == "open" and r["rate_rps"] == 300 and r["arrival"] == "poisson"
    assert r["concurrency"] is None and r["max_send_lag_ms"] is not None
    assert "ratios" not in rep  # only compare and quick carry ratios


def test_nothing_measured_is_an_error_exit(tmp_path, monkeypatch):
    monkeypatch.setitem(PEERS, "fake-off", fake_peer("fake-off", ok=False))
    out = tmp_path / "none.json"
    assert cli.main(["latency", "--peers", "fake-off", "--json", str(out), *FAST]) == 1
    rep = json.loads(out.read_text())
    assert rep["results"] == [] and rep["skipped"][0]["peer"] == "fake-off"


def test_an_output_that_cannot_be_written_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    """A mistyped --json or --plots was found only after the whole run had measured (the
    command-line hunt): now before any peer starts, exit 2, one line naming the flag."""
    started = []
    monkeypatch.setitem(PEERS, "fake-a", fake_peer("fake-a", 1.0))
    monkeypatch.setattr(PEERS["fake-a"], "start", lambda self: started.append(1))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for extra, words in ((["--json", str(tmp_path)], ["--json", "is a directory"]),
                         (["--json", str(a_file / "r.json")], ["--json", "is not a directory"]),
                         (["--plots", str(a_file)], ["--plots", "is not a directory"]),
                         (["--markdown", str(a_file / "x" / "t.md")], ["--markdown", "is not a directory"])):
        assert cli.main(["latency", "--peers", "fake-a", *extra, *FAST]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        for w in words:
            assert w in err, err
    assert started == []
    from bench import run

    assert run.main(["--endpoint", "ipc:///nowhere.ipc", "--service", "echo", "--csv", str(tmp_path)]) == 2
    assert "--csv" in capsys.readouterr().err


def test_quick_smoke_subprocess_with_real_floor_peers(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "quick", "--peers", "direct,proxy,grpc,pytriton",
         "--sizes", "16,64k", "--window-s", "0.05", "--warmup-s", "0.02",
         "--max-duration-s", "0.3", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "p50" in proc.stdout and "direct" in proc.stdout  # the terminal table
    rep = json.loads(out.read_text())
    assert rep["command"] == "quick"
    got = {(r["peer"], r["payload_bytes"]) for r in rep["results"]}
    assert got == {(p, n) for p in ("direct", "proxy", "grpc") for n in (16, 65536)}
    for r in rep["results"]:
        assert r["requests"] > 0 and r["errors"] == 0, r
    if rep["peers"]["pytriton"]["status"] != "ok":
        assert rep["peers"]["pytriton"]["reason"]
        assert "pytriton" in proc.stdout  # listed as skipped in the table's footer
    assert rep["ratios"]["broker_vs_direct_tiny"] is None or "broker-shm" in rep["peers"]


def test_peer_plugins_register_and_a_broken_default_plugin_is_reported(tmp_path, monkeypatch):
    from bench import peers as peers_mod

    (tmp_path / "zb_good_plugin.py").write_text(
        "from bench.peers import Peer, register\n"
        "from tests.bench.test_report_cli import SleepClient\n"
        "@register\n"
        "class P(Peer):\n"
        "    name = 'plug-peer'\n"
        "    description = 'registered by a plug-in module'\n"
        "    def start(self): pass\n"
        "    def client(self): return SleepClient(0.5, 0.0, False)\n")
    (tmp_path / "zb_bad_plugin.py").write_text("raise ImportError('broker package missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(peers_mod, "DEFAULT_PLUGIN_MODULES", ("zb_bad_plugin",))
    monkeypatch.setattr(peers_mod, "PLUGIN_ERRORS", {})
    out = tmp_path / "p.json"
    try:
        rc = cli.main(["compare", "--peer-module", "zb_good_plugin", "--peers",
                       "plug-peer,broker-shm", "--sizes", "16", "--json", str(out), *FAST])
    finally:
        PEERS.pop("plug-peer", None)
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["peers"]["plug-peer"]["status"] == "ok"
    assert rep["results"][0]["peer"] == "plug-peer"
    if rep["peers"]["broker-shm"]["status"] != "ok":
        assert "broker package missing" in rep["peers"]["broker-shm"]["reason"]


@pytest.mark.parametrize("args", [["latency", "--concurrency", "0"], ["latency", "--concurrency", "-1"],
                                  ["rate", "--rate", "0"], ["rate", "--rate", "nan"], ["compare", "--rate", "0"],
                                  ["sweep", "--rates", "nan"], ["latency", "--window-s", "nan"],
                                  ["latency", "--window-s", "0"], ["latency", "--warmup-s", "-1"],
                                  ["latency", "--max-duration-s", "-1"], ["latency", "--stable-windows", "0"],
                                  ["latency", "--tolerance", "nan"], ["latency", "--min-requests", "0"],
                                  ["latency", "--slo-ms", "-1"], ["latency", "--spin-us", "-5"],
                                  ["latency", "--timeout-s", "nan"], ["latency", "--timeout-s", "-1"]])
def test_the_peer_subcommands_refuse_numbers_out_of_range(args, monkeypatch, capsys):
    # Found by the bench audit: a concurrency of 0 measured nothing and said "stable", a rate
    # of 0 ran closed loop, a NaN timeout meant none, a NaN rate was a traceback after the
    # peers had started.  Each is a usage error now, exit 2 before anything starts.
    started = []
    monkeypatch.setitem(PEERS, "fake-a", fake_peer("fake-a", 1.0))
    monkeypatch.setattr(PEERS["fake-a"], "start", lambda self: started.append(1))
    with pytest.raises(SystemExit) as e:
        cli.main([*args, "--peers", "fake-a", "--quiet"])
    assert e.value.code == 2 and started == []
    err = capsys.readouterr().err
    assert "expected" in err or "out of range" in err, err


def test_render_says_what_is_wrong_with_its_input_in_one_line(tmp_path, capsys):
    # A missing file, a JSON that is no report, a file that is not JSON, an output that
    # cannot be written: tracebacks before (the bench audit).
    not_json = tmp_path / "x.txt"
    not_json.write_text("hello")
    empty = tmp_path / "e.json"
    empty.write_text("{}")
    for args in ([str(tmp_path / "missing.json")], [str(empty)], [str(not_json)],
                 [str(empty), "--plots", str(not_json)]):
        assert cli.main(["render", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err


def test_ctrl_c_while_a_peer_starts_stops_the_run(monkeypatch, capsys):
    # Found by the bench audit: spawn() turned the KeyboardInterrupt into that peer's start
    # failure, and the run went on against the peers the same Ctrl-C had stopped, exit 0.
    stopped = []
    monkeypatch.setitem(PEERS, "fake-a", fake_peer("fake-a", 1.0))
    monkeypatch.setitem(PEERS, "fake-b", fake_peer("fake-b", 1.0))
    monkeypatch.setattr(PEERS["fake-a"], "stop", lambda self: stopped.append("a"))
    monkeypatch.setattr(PEERS["fake-b"], "stop", lambda self: stopped.append("b"))

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(PEERS["fake-b"], "start", interrupted)
    assert cli.main(["latency", "--peers", "fake-a,fake-b", *FAST]) == 130
    assert sorted(stopped) == ["a", "b"] and "interrupted" in capsys.readouterr().err


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        out.update(kids)
        todo.extend(kids)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_sigterm_to_the_harness_stops_its_broker_and_worker_peers(tmp_path):
    # Found by the bench audit: `timeout` (SIGTERM) ended the harness at once; the broker and
    # worker peers it had started ran on, their temporary directories kept.
    import signal
    import time

    env = dict(os.environ, TMPDIR=str(tmp_path))
    h = subprocess.Popen([sys.executable, "-m", "bench", "latency", "--peers", "broker-shm", "--window-s", "0.2",
                          "--warmup-s", "0", "--max-duration-s", "60", "--quiet"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while True:  # until its worker peer runs (the broker before it)
            kids |= _descendants(h.pid)
            if any("gpu_worker" in _cmdline(k) for k in kids):
                break
            assert h.poll() is None, h.stderr.read()
            assert time.monotonic() < deadline, "the peers did not start"
            time.sleep(0.05)  # polling /proc (a condition, not a delay)
        h.send_signal(signal.SIGTERM)
        assert h.wait(30) == 143
        deadline = time.monotonic() + 20
        while any(os.path.exists(f"/proc/{k}") and _cmdline(k) for k in kids):
            assert time.monotonic() < deadline, [_cmdline(k) for k in kids if _cmdline(k)]
            time.sleep(0.05)
        assert not [p for p in os.listdir(tmp_path) if p.startswith("zbench-")], os.listdir(tmp_path)
    finally:
        if h.poll() is None:
            h.kill()
            h.wait(10)
        h.stderr.close()
        for k in kids:  # (what a failure left: never another process that took a pid since)
            if str(tmp_path) not in _cmdline(k):
                continue
            try:
                os.kill(k, signal.SIGKILL)
            except OSError:
                pass


def test_a_signal_while_a_peer_process_starts_comes_once_it_is_tracked():
    """`bench.peers.signals_held`: a SIGTERM (or Ctrl-C) that came while `subprocess.Popen`
    waited for a peer's exec raised inside it, and the started worker was never tracked:
    it ran on after the harness exited.  Held, it is raised once the block is left, to the
    handler it was meant for."""
    import signal

    from bench.peers import signals_held

    seen = []

    def handler(signum, frame):
        seen.append(signum)
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(SystemExit) as e:
            with signals_held():
                signal.raise_signal(signal.SIGTERM)
                tracked = True  # what follows the signal in the block still runs
        assert tracked and seen == [signal.SIGTERM] and e.value.code == 143
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, old)
