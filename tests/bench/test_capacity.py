"""bench.capacity: ranges, the SLO rule, the capacity search, the knee and the report's
"search" object, against fake systems whose true capacity is known."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.capacity import (DEFAULT_CAP, RangeError, Search, evaluate, expand_range, knee,
                            parse_range_bounds, summary)

# -- ranges ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, integer, levels", [
    ("4", True, [4]),
    ("1:4", True, [1, 2, 3, 4]),
    ("1:16:4", True, [1, 5, 9, 13]),
    ("2:16:2", True, [2, 4, 6, 8, 10, 12, 14, 16]),
    (" 3 : 3 ", True, [3]),
    ("100", False, [100.0]),
    ("100:1000:300", False, [100.0, 400.0, 700.0, 1000.0]),
    ("0.1:0.3:0.1", False, [0.1, 0.2, 0.3]),  # END kept despite 0.1 + 2 * 0.1 > 0.3
    ("0.5:2", False, [0.5, 1.5]),
    ("1:2:0.25", False, [1.0, 1.25, 1.5, 1.75, 2.0]),
])
def test_expand_range(text, integer, levels):
    got = expand_range(text, integer)
    assert got == levels
    assert all(isinstance(v, int if integer else float) for v in got)


@pytest.mark.parametrize("text, integer, message", [
    ("", True, "is not an integer"),
    ("abc", False, "is not a number"),
    ("1.5", True, "is not an integer"),
    ("0", True, ">= 1"),
    ("0:4", True, ">= 1"),
    ("-1", False, "> 0"),
    ("0:10", False, "> 0"),
    ("8:4", True, "START 8 is greater than END 4"),
    ("1:4:0", True, "STEP must be > 0"),
    ("1:4:-1", False, "STEP must be > 0"),
    ("1:2:3:4", True, "START:END[:STEP]"),
    ("1:", True, "is not an integer"),
    ("inf", False, "not finite"),
    ("nan", False, "not finite"),
    ("1:1000000", False, "levels"),
])
def test_expand_range_errors(text, integer, message):
    with pytest.raises(RangeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        expand_range(text, integer)
    assert issubclass(RangeError, ValueError)


def test_parse_range_bounds():
    assert parse_range_bounds("8", True) == (8, None)
    assert parse_range_bounds("8:64", True) == (8, 64)
    assert parse_range_bounds("8:64:4", True) == (8, 64)
    assert parse_range_bounds("100:5000:100", False) == (100.0, 5000.0)
    for bad in ("64:8", "0", "x:8"):
        with pytest.raises(RangeError):
            parse_range_bounds(bad, True)


# -- evaluate -------------------------------------------------------------------------------

CFG = {"slo_ms": 10.0, "percentile": 99.0, "max_error_rate": 0.001, "max_drop_rate": 0.01}


def level(**kw):
    r = {"mode": "open", "load": 100, "requests": 1000, "errors": 0, "valid": True, "invalid_reason": None,
         "percentile_ms": 5.0, "window_percentile_ms": [4.0, 5.0, 6.0], "streams_detail": None}
    r.update(kw)
    return r


@pytest.mark.parametrize("kw, why_not", [
    ({}, None),
    ({"errors": 1, "requests": 999}, None),  # exactly the limit holds
    ({"window_percentile_ms": [10.0, 10.0]}, None),
    ({"valid": False, "invalid_reason": "p99 lateness 2.1 ms > 1 ms"}, "invalid: p99 lateness 2.1 ms > 1 ms"),
    ({"valid": False}, "invalid"),
    ({"requests": 0, "errors": 5, "window_percentile_ms": [None]}, "no successful request"),
    ({"requests": 98, "errors": 2}, "error rate 2.0% > 0.1%"),
    ({"requests": 9988, "errors": 12}, "error rate 0.12% > 0.10%"),  # digits enough to tell them apart
    ({"window_percentile_ms": [5.0, 12.3, 20.0]}, "window 2 p99 12.3 ms > SLO 10 ms"),
    ({"window_percentile_ms": [10.004]}, "window 1 p99 10.004 ms > SLO 10 ms"),
    ({"window_percentile_ms": [1234.56]}, "window 1 p99 1235 ms > SLO 10 ms"),
    ({"window_percentile_ms": [None, 1.0]}, "window 1 p99 n/a (no successful request)"),
    ({"window_percentile_ms": [1.0, float("nan")]}, "window 2 p99 n/a (no successful request)"),
    ({"window_percentile_ms": []}, "no window measured"),
    # the first failing check wins
    ({"valid": False, "invalid_reason": "late", "errors": 500}, "invalid: late"),
    ({"errors": 500, "window_percentile_ms": [50.0]}, "error rate 33.3% > 0.1%"),
])
def test_evaluate(kw, why_not):
    assert evaluate(level(**kw), CFG) == (why_not is None, why_not)


def test_evaluate_percentile_label_and_streams():
    assert evaluate(level(window_percentile_ms=[11.0]), {**CFG, "percentile": 99.9}) == \
        (False, "window 1 p99.9 11 ms > SLO 10 ms")
    streams = level(mode="streams", streams_detail={"drop_rate": 0.03, "stream_equivalents": 2.0})
    assert evaluate(streams, CFG) == (False, "drop rate 3.0% > 1.0%")
    assert evaluate({**streams, "streams_detail": {"drop_rate": 0.01}}, CFG) == (True, None)
    assert evaluate({**streams, "window_percentile_ms": [11.0]}, CFG)[1].startswith("window 1")
    # drops only matter for streams
    assert evaluate(level(streams_detail={"drop_rate": 0.5}), CFG) == (True, None)


# -- the search -----------------------------------------------------------------------------


def drive(search: Search, holds) -> Search:
    """Run `search` against a fake system: `holds(load, n)` for the n-th measurement."""
    seen = []
    while (load := search.next_load()) is not None:
        assert load not in seen, f"{load} measured twice"
        assert search.start <= load <= search.cap
        if search.integer:
            assert isinstance(load, int)
        seen.append(load)
        ok = holds(load, len(seen))
        search.record(load, ok, percentile_ms=1.0, throughput_rps=float(load), why_not=None if ok else "slow")
        assert len(seen) < 200
    assert search.done and [s["load"] for s in search.steps] == seen
    held = [s["load"] for s in search.steps if s["holds"]]
    assert search.capacity == (max(held) if held else None)
    return search


def rate_bound(s: Search) -> float:
    return math.log2(s.cap / s.start) + math.log2(1 / s.resolution) + 4


def int_bound(s: Search) -> float:
    return math.log2(s.cap / s.start) + math.log2(s.cap) + 3


@settings(max_examples=300, deadline=None)
@given(start=st.floats(0.1, 1e4), span=st.floats(1.0, 1e4), where=st.floats(0.0, 1.0),
       resolution=st.sampled_from([0.05, 0.01, 0.1, 0.2]))
def test_rate_search_finds_capacity_within_resolution(start, span, where, resolution):
    cap = start * span
    true_c = start * span ** where  # anywhere in [start, cap]
    s = drive(Search("rate", start, cap, resolution), lambda load, n: load <= true_c)
    c = s.capacity
    assert c is not None and c <= true_c
    if c == cap:
        assert true_c >= cap
    else:
        assert true_c / c - 1 <= resolution
    assert len(s.steps) <= rate_bound(s)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["concurrency", "streams"]), start=st.integers(1, 200),
       extra=st.integers(0, 4000), data=st.data())
def test_integer_search_finds_exact_capacity(kind, start, extra, data):
    cap = start + extra
    true_c = data.draw(st.integers(start, cap))
    s = drive(Search(kind, start, cap), lambda load, n: load <= true_c)
    assert s.capacity == true_c
    assert len(s.steps) <= int_bound(s)


def test_search_examples():
    s = drive(Search("rate", 100), lambda load, n: load <= 350)
    loads = [st_["load"] for st_ in s.steps]
    assert loads[:3] == [100, 200, 400]
    assert all(float(f"{x:.3g}") == x for x in loads)  # readable: 3 significant digits
    assert 350 / s.capacity - 1 <= 0.05 and s.capacity <= 350
    assert len(s.steps) <= 2 * math.log2(DEFAULT_CAP["rate"] / 100) + 3
    line = s.describe()
    assert line.startswith("search: 100 ok, 200 ok, 400 FAIL (slow), 300 ok")
    assert line.endswith(f"-> capacity {s.capacity:g}/s")

    s = drive(Search("concurrency", 1), lambda load, n: load <= 12)
    assert [x["load"] for x in s.steps] == [1, 2, 4, 8, 16, 12, 14, 13]
    assert s.capacity == 12 and s.describe().endswith("-> capacity 12 in flight")


def test_search_start_fails_and_cap_holds():
    s = drive(Search("rate", 100, 1000), lambda load, n: False)
    assert s.capacity is None and len(s.steps) == 1
    assert s.describe() == "search: 100 FAIL (slow) -> no capacity (start 100 did not hold)"

    s = drive(Search("streams", 3, 20), lambda load, n: True)
    assert [x["load"] for x in s.steps] == [3, 6, 12, 20] and s.capacity == 20
    assert s.describe().endswith("capacity 20 streams (the cap)")

    s = drive(Search("concurrency", 5, 5), lambda load, n: True)
    assert s.capacity == 5 and len(s.steps) == 1

    s = drive(Search("concurrency", 1), lambda load, n: True)
    assert s.capacity == DEFAULT_CAP["concurrency"] and len(s.steps) == 13


def test_search_stops_when_adjacent_at_the_cap():
    s = drive(Search("concurrency", 4, 5), lambda load, n: load <= 4)
    assert [x["load"] for x in s.steps] == [4, 5] and s.capacity == 4
    s = drive(Search("rate", 100, 104), lambda load, n: load <= 100)  # within 5 %: no bisection
    assert [x["load"] for x in s.steps] == [100, 104] and s.capacity == 100


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["rate", "concurrency"]), true_c=st.integers(1, 3000), flaky=st.integers(1, 30))
def test_noise_still_ends_on_a_load_that_held(kind, true_c, flaky):
    """A system that fails once, at its `flaky`-th measurement, although the load was fine."""
    s = drive(Search(kind, 1, 4096), lambda load, n: load <= true_c and n != flaky)
    assert s.capacity is None or s.capacity <= true_c
    if flaky > 1:
        assert s.capacity is not None
        assert any(x["holds"] and x["load"] == s.capacity for x in s.steps)
    bound = rate_bound(s) if kind == "rate" else int_bound(s)
    assert len(s.steps) <= bound


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["rate", "concurrency", "streams"]), start=st.integers(1, 50),
       answers=st.lists(st.booleans(), min_size=40, max_size=40))
def test_any_answers_terminate_without_repeats(kind, start, answers):
    s = drive(Search(kind, start, 1000), lambda load, n: answers[n - 1])
    bound = rate_bound(s) if kind == "rate" else int_bound(s)
    assert len(s.steps) <= bound


def test_search_rejects_misuse():
    s = Search("rate", 100, 1000)
    with pytest.raises(ValueError, match="expected a result for load 100"):
        s.record(200, True)
    s.record(100, False, why_not="x")
    with pytest.raises(RuntimeError):
        s.record(100, True)
    for args in [("bogus", 1), ("concurrency", 2.5), ("rate", 0), ("rate", 10, 5), ("streams", 1, 10.5)]:
        with pytest.raises(ValueError):
            Search(*args)
    assert Search("concurrency", 3.0, 8.0).next_load() == 3  # integral floats are accepted as ints
    assert s.steps == [{"load": 100, "holds": False, "percentile_ms": None, "throughput_rps": None, "why_not": "x"}]


def test_search_tiny_resolution_keeps_the_guarantee():
    s = drive(Search("rate", 1000, 2000, resolution=1e-4), lambda load, n: load <= 1234.5678)
    assert s.capacity <= 1234.5678 and 1234.5678 / s.capacity - 1 <= 1e-4


# -- knee -----------------------------------------------------------------------------------


def test_knee():
    assert knee([(1, 1.0), (2, 1.5), (4, 2.0), (8, 5.0)]) == 4
    assert knee([(8, 5.0), (1, 1.0), (4, 2.0), (2, 1.5)]) == 4  # any order
    assert knee([(100, 1.0), (200, 3.0), (400, 1.9)]) == 400  # the highest, not the first run
    assert knee([(1, None), (2, 1.0), (4, float("nan")), (8, 2.5)]) == 2  # 2 is the lowest measured
    assert knee([(5, 3.0)]) == 5
    assert knee([]) is None and knee([(1, None)]) is None


# -- summary --------------------------------------------------------------------------------


def result(load, holds, p, tput, mode="open", eq=None, why=None):
    return {"mode": mode, "load": load, "holds_slo": holds, "percentile_ms": p, "throughput_rps": tput,
            "why_not": None if holds else (why or "window 1 p99 20 ms > SLO 10 ms"),
            "streams_detail": None if mode != "streams" else {"drop_rate": 0.0, "stream_equivalents": eq}}


def test_summary_unsearched():
    results = [result(100, True, 1.0, 99.0), result(200, True, 1.8, 198.0),
               result(400, False, 30.0, 350.0), result(300, True, 4.0, 297.0)]
    got = summary(results, CFG, "rate", searched=False)
    assert got == {
        "searched": False, "kind": "rate", "slo_ms": 10.0, "percentile": 99.0,
        "steps": [{"load": r["load"], "holds": r["holds_slo"], "percentile_ms": r["percentile_ms"],
                   "throughput_rps": r["throughput_rps"], "why_not": r["why_not"]} for r in results],
        "capacity": 300, "capacity_throughput_rps": 297.0, "limited_by": "slo",
        "stream_equivalents": None, "knee": 200,
    }
    none = summary([result(100, False, 30.0, 80.0)], CFG, "concurrency", searched=False)
    assert none["capacity"] is None and none["capacity_throughput_rps"] is None and none["knee"] == 100
    empty = summary([], CFG, "rate", searched=False)
    assert empty["steps"] == [] and empty["capacity"] is None and empty["knee"] is None


def test_summary_a_level_that_held_above_a_failure_is_not_the_capacity():
    """Range mode: 300 failed (noise, or the real knee), 400 then held: capacity is 200."""
    results = [result(100, True, 1.0, 99.0), result(200, True, 1.8, 198.0),
               result(300, False, 30.0, 290.0), result(400, True, 4.0, 397.0)]
    got = summary(results, CFG, "rate", searched=False)
    assert got["capacity"] == 200 and got["capacity_throughput_rps"] == 198.0
    assert got["limited_by"] == "slo"


def test_summary_says_when_the_load_generator_was_the_limit():
    results = [result(100, True, 1.0, 99.0),
               result(200, False, 3.0, 199.0, why="invalid: the load generator ran late: ...")]
    got = summary(results, CFG, "rate", searched=False)
    assert got["capacity"] == 100 and got["limited_by"] == "generator"
    assert summary([result(100, True, 1.0, 99.0)], CFG, "rate", searched=False)["limited_by"] is None


def test_summary_searched_uses_the_search_steps():
    s = Search("concurrency", 1, 8)
    measured = []
    while (load := s.next_load()) is not None:
        r = result(load, load <= 5, float(load), 10.0 * load)
        measured.append(r)
        s.record(load, r["holds_slo"], r["percentile_ms"], r["throughput_rps"], r["why_not"])
    got = summary(measured, CFG, "concurrency", searched=True, steps=s.steps)
    assert got["searched"] is True and got["steps"] == s.steps and got["steps"] is not s.steps
    assert got["capacity"] == s.capacity == 5 and got["capacity_throughput_rps"] == 50.0
    assert got["knee"] == 2  # p at 1 is 1 ms: loads up to 2 ms


def test_summary_streams():
    held = [result(1, True, 20.0, 30.0, "streams", 1.0), result(2, True, 25.0, 60.0, "streams", 2.0),
            result(4, False, 80.0, 90.0, "streams", 2.9), result(3, True, 30.0, 88.0, "streams", 2.8)]
    got = summary(held, {"slo_ms": 33.0, "percentile": 99.0}, "streams", searched=False)
    assert got["capacity"] == 3 and got["stream_equivalents"] == 2.8 and got["capacity_throughput_rps"] == 88.0
    # a model slower than a frame period: no level holds, the best fractional figure is reported
    slow = [result(1, False, 50.0, 18.0, "streams", 0.6), result(2, False, 90.0, 19.0, "streams", 0.63),
            result(4, False, 200.0, 19.5, "streams", None)]
    got = summary(slow, {"slo_ms": 33.0, "percentile": 99.0}, "streams", searched=False)
    assert got["capacity"] is None and got["stream_equivalents"] == 0.63
    # other kinds never report stream equivalents
    assert summary(held, CFG, "rate", searched=False)["stream_equivalents"] is None
