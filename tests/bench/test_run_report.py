"""bench.run_report: CSV (perf_analyzer columns and units), table, markdown and plots of a
"zinf-bench-run/1" report, from synthetic reports in closed, open and streams modes."""
from __future__ import annotations

import copy
import csv
import random

import pytest

from bench import run_report as rr
from bench.hist import LatencyHistogram

PA_TAIL = ["Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
           "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
           "p50 latency", "p90 latency", "p95 latency", "p99 latency", "Avg latency",
           "Server Batch Wait", "Batch Size", "Errors", "Requests", "Lateness p99", "Valid",
           "Holds SLO", "FPS", "Drop Rate", "Stream Equivalents"]
FIRST = {"closed": "Concurrency", "open": "Request Rate", "streams": "Streams"}
SLO = 10.0


def _hist(base_ms: float, n: int, seed: int) -> LatencyHistogram:
    rnd = random.Random(seed)
    h = LatencyHistogram()
    for _ in range(n):
        h.record_ns(int(base_ms * 1e6 * rnd.lognormvariate(0, 0.4)))
    return h


def _result(mode: str, load, base_ms: float, seed: int, fps: float | None = None) -> dict:
    n = 600
    h = _hist(base_ms, n, seed)
    lat = {k: round(v, 3) for k, v in h.summary_ms().items()}
    p = h.percentile_ms(99.0)
    holds = p <= SLO
    streams = mode == "streams"
    per_stream = [{"stream": i, "frames": 60, "sent": 60, "completed": 58, "dropped": 2, "failed": 0,
                   "achieved_fps": 29.0, "p50_ms": lat["p50"], "p99_ms": round(lat["p99"] + i * 0.3, 3)}
                  for i in range(load)] if streams else None
    return {
        "mode": mode, "load": load,
        "concurrency": load if mode == "closed" else None,
        "rate_rps": load if mode == "open" else None,
        "streams": load if streams else None, "fps": fps,
        "requests": n, "errors": 1, "timeouts": 0, "error_samples": ["TimeoutError: 30 s"],
        "measured_s": 6.0, "throughput_rps": round(n / 6.0 * (1 + seed / 100), 2),
        "latency_ms": lat, "percentile_ms": p,
        "window_percentile_ms": [p, p, p], "window_throughput_rps": [100.0] * 3,
        "slo_attainment": round(h.count_at_or_below_ms(SLO) / (n + 1), 5),
        "holds_slo": holds, "why_not": None if holds else f"p99 {p:.2f} ms > {SLO:g} ms",
        "valid": True, "invalid_reason": None,
        "lateness_ms": None if mode == "closed" else {"p50": 0.01, "p99": 0.05, "max": 0.3},
        "server_ms": {"queue": 0.02, "batch_wait": 0.11, "input": 0.01, "compute": 0.35, "output": 0.01},
        "server_samples": n,
        "batch_size": {"mean": 1.5, "counts": {"1": 300, "2": 300}},
        "server_metrics": None,
        "streams_detail": {"drop_rate": 0.0333, "achieved_fps": 29.0, "stream_equivalents": 0.9 * load,
                           "per_stream": per_stream} if streams else None,
        "generator": {"processes": 1, "cpu_s": 0.8 + seed / 10, "cpu_cores": 0.13 + seed / 100},
        "hdr": h.encode(),
    }


def make_report(mode: str) -> dict:
    fps = 30.0 if mode == "streams" else None
    loads = {"closed": [1, 2, 4, 8], "open": [100, 200, 400, 300], "streams": [1, 2, 4, 3]}[mode]
    bases = {1: 1.0, 2: 1.5, 4: 9.0, 8: 12.0, 100: 1.0, 200: 1.5, 400: 9.0, 300: 2.0, 3: 2.0}
    results = [_result(mode, ld, bases[ld], i, fps) for i, ld in enumerate(loads)]
    # the highest level: the generator could not keep up, so it is invalid
    results[2]["valid"] = False
    results[2]["holds_slo"] = False
    results[2]["invalid_reason"] = "generator p99 lateness 2.30 ms > 1 ms"
    kind = {"closed": "concurrency", "open": "rate", "streams": "streams"}[mode]
    held = [r for r in results if r["holds_slo"]]
    cap = max(held, key=lambda r: r["load"])
    return {
        "schema": rr.SCHEMA, "command": "run",
        "argv": ["run", "--endpoint", "ipc:///tmp/b", "--service", "echo"],
        "command_line": "run --endpoint ipc:///tmp/b --service echo",
        "started_at": "2024-01-01T00:00:00Z", "wall_s": 12.3,
        "machine": {"cpu_model": "Test CPU", "cores": 2, "python": "3.11.0", "pyzmq": "26.0",
                    "libzmq": "4.3.5"},
        "target": {"endpoint": "ipc:///tmp/b", "service": "echo", "transport": "auto"},
        "inputs": {"source": "random", "path": None, "samples": 1,
                   "tensors": {"x": {"shape": [16], "dtype": "uint8"}},
                   "bytes_per_request": 16, "digests": [{"x": "3f9a0000deadbeef"}]},
        "config": {"mode": mode, "levels": sorted(loads), "arrival": "constant" if mode == "open" else None,
                   "fps": fps, "max_in_flight": 1 if mode == "streams" else None,
                   "window_s": 2.0, "warmup_s": 0.5, "windows": 3, "timeout_s": 30.0, "seed": 1,
                   "slo_ms": SLO, "percentile": 99.0, "search": True, "resolution": 0.05,
                   "max_error_rate": 0.001, "max_drop_rate": 0.01, "max_lateness_ms": 1.0,
                   "workers": 1, "spin_us": 1000.0, "metrics_url": None},
        "results": results,
        "search": {"searched": True, "kind": kind, "slo_ms": SLO, "percentile": 99.0,
                   "steps": [{"load": r["load"], "holds": r["holds_slo"], "percentile_ms": r["percentile_ms"],
                              "throughput_rps": r["throughput_rps"], "why_not": r["why_not"]}
                             for r in results],
                   "capacity": cap["load"], "capacity_throughput_rps": cap["throughput_rps"],
                   "stream_equivalents": 2.7 if mode == "streams" else None,
                   "knee": cap["load"]},
    }


def _read_csv(report: dict, tmp_path) -> tuple[list[str], list[dict]]:
    path = tmp_path / "out" / "run.csv"
    rr.write_csv(report, str(path))
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


MODES = ["closed", "open", "streams"]


@pytest.mark.parametrize("mode", MODES)
def test_csv_header_and_values(mode, tmp_path):
    rep = make_report(mode)
    assert rr.is_run_report(rep) and not rr.is_run_report({"schema": "zinf-bench/1"})
    header, rows = _read_csv(rep, tmp_path)
    assert header == [FIRST[mode]] + PA_TAIL == rr.csv_columns(mode)
    assert rr.CSV_COLUMNS == PA_TAIL and rr.CSV_EXTRA_COLUMNS == PA_TAIL[13:]
    assert len(rows) == len(rep["results"])
    for row, r in zip(rows, rep["results"]):  # in measured order
        lat, srv = r["latency_ms"], r["server_ms"]
        assert int(row[FIRST[mode]]) == r["load"]
        assert int(row["p99 latency"]) == round(lat["p99"] * 1000)
        assert int(row["p50 latency"]) == round(lat["p50"] * 1000)
        assert int(row["Avg latency"]) == round(lat["mean"] * 1000)
        assert float(row["Inferences/Second"]) == round(r["throughput_rps"], 1)
        assert int(row["Errors"]) == r["errors"] and int(row["Requests"]) == r["requests"]
        assert row["Client Send"] == row["Client Recv"] == "0"
        assert int(row["Server Queue"]) == round((srv["queue"] + srv["batch_wait"]) * 1000)
        assert int(row["Server Batch Wait"]) == round(srv["batch_wait"] * 1000)
        assert int(row["Server Compute Infer"]) == round(srv["compute"] * 1000)
        split = sum(srv.values())
        assert int(row["Network+Server Send/Recv"]) == round((lat["mean"] - split) * 1000)
        assert float(row["Batch Size"]) == 1.5
        assert row["Valid"] == ("true" if r["valid"] else "false")
        assert row["Holds SLO"] == ("true" if r["holds_slo"] else "false")
        if mode == "closed":
            assert row["Lateness p99"] == ""
        else:
            assert int(row["Lateness p99"]) == 50
        if mode == "streams":
            assert float(row["FPS"]) == 29.0 and float(row["Drop Rate"]) == 0.0333
            assert float(row["Stream Equivalents"]) == pytest.approx(0.9 * r["load"])
        else:
            assert row["FPS"] == row["Drop Rate"] == row["Stream Equivalents"] == ""


def test_csv_none_fields_give_empty_cells(tmp_path):
    rep = make_report("streams")
    r = rep["results"][0]
    r.update(server_ms=None, batch_size=None, lateness_ms=None, streams_detail=None, hdr=None,
             throughput_rps=None, valid=None, holds_slo=None)
    r["latency_ms"] = {k: None for k in r["latency_ms"]}
    _, rows = _read_csv(rep, tmp_path)
    row = rows[0]
    for col in ("Server Queue", "Server Batch Wait", "Server Compute Input", "Server Compute Infer",
                "Server Compute Output", "Batch Size", "Lateness p99", "FPS", "Drop Rate",
                "Stream Equivalents", "Inferences/Second", "p99 latency", "Avg latency",
                "Network+Server Send/Recv", "Valid", "Holds SLO"):
        assert row[col] == "", col
    # a known mean with no server split: it is all network + server as seen by the client
    rep2 = make_report("closed")
    rep2["results"][0]["server_ms"] = None
    rep2["results"][1]["server_ms"] = {"queue": None, "batch_wait": None, "input": 0.01,
                                       "compute": 100.0, "output": None}
    rows2 = rr.csv_rows(rep2)
    assert rows2[0]["Network+Server Send/Recv"] == round(rep2["results"][0]["latency_ms"]["mean"] * 1000)
    assert rows2[1]["Server Queue"] == "" and rows2[1]["Network+Server Send/Recv"] == 0  # clamped


@pytest.mark.parametrize("mode", MODES)
def test_table_and_markdown(mode, tmp_path):
    rep = make_report(mode)
    cap = rep["search"]["capacity"]
    unit = {"closed": f"concurrency {cap}", "open": f"{cap} req/s",
            "streams": f"{cap} streams at 30 fps"}[mode]
    want = (f"capacity at p99 <= 10 ms: {unit} "
            f"({rep['search']['capacity_throughput_rps']:.1f} req/s achieved)")
    table = rr.render_table(rep)
    path = tmp_path / "run.md"
    rr.write_markdown(rep, str(path))
    md = path.read_text()
    assert md == rr.render_markdown(rep)
    for text in (table, md):
        assert want in text and f"knee {cap}" in text
        assert "INVALID" in text and "generator p99 lateness 2.30 ms > 1 ms" in text
        assert "TimeoutError: 30 s" in text and "generator cpu" in text
        assert "x=16:uint8" in text and "echo at ipc:///tmp/b" in text
        assert ("drop%" in text) == (mode == "streams")
        assert ("stream equivalents 2.70" in text) == (mode == "streams")
    assert rep["command_line"] in md and "Test CPU, 2 cores" in md
    assert md.count("\n| ") == len(rep["results"]) + 1  # header + one row per level
    # rows in load order in the table
    labels = [ln.split()[0] for ln in table.splitlines()[2:2 + len(rep["results"])]]
    assert labels == [rr._load_label(r, mode) for r in sorted(rep["results"], key=lambda r: r["load"])]


def test_table_robust_to_missing_optional_fields():
    rep = make_report("open")
    rep["search"].update(capacity=None, capacity_throughput_rps=None, knee=None)
    for r in rep["results"]:
        r.update(server_ms=None, batch_size=None, lateness_ms=None, hdr=None, generator=None)
    table = rr.render_table(rep)
    assert "capacity at p99 <= 10 ms: none" in table
    bare = {"schema": rr.SCHEMA, "config": {"mode": "closed"}, "results": [{"mode": "closed", "load": 1}]}
    assert "c=1" in rr.render_table(bare) and "c=1" in rr.render_markdown(bare)
    assert rr.csv_rows(bare)[0]["Concurrency"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_plots(mode, tmp_path):
    rep = make_report(mode)
    rep["results"][1]["hdr"] = None  # skipped in the CDF
    out = tmp_path / "plots"
    paths = rr.write_plots(rep, str(out))
    names = sorted(p.rsplit("/", 1)[1] for p in paths)
    want = ["cdf.png", "latency_vs_throughput.png"] + (["streams_p99.png"] if mode == "streams" else [])
    assert names == sorted(want)
    assert sorted(p.name for p in out.iterdir()) == sorted(want)
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert (out / p.rsplit("/", 1)[1]).stat().st_size > 1000


def test_plots_with_nothing_known(tmp_path):
    rep = copy.deepcopy(make_report("streams"))
    rep["search"] = None
    for r in rep["results"]:
        r.update(hdr=None, streams_detail=None, throughput_rps=None)
    assert len(rr.write_plots(rep, str(tmp_path))) == 3
