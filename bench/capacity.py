"""What `bench run` decides from what it measured: load ranges, the SLO rule, the capacity search.

Pure logic: the runner measures a load level and hands the figures here; this module says
whether the level held the SLO, which level to measure next, and what the report's "search"
object says (docs/bench.md, "Capacity search").

Ranges are perf_analyzer's `START:END[:STEP]` (END inclusive, STEP 1 unless given); a single
value is a range of one.

A level **holds** when it is valid, at least one request succeeded, its error rate
errors / (requests + errors) is at most `max_error_rate`, the P-th percentile of every one of
its windows is at most `slo_ms`, and (streams) its drop rate is at most `max_drop_rate`.  The
first condition that fails, in that order, is the level's `why_not`.

The **search** doubles the load from START while levels hold (clamped to the cap; a cap that
holds ends it), then bisects between the highest load that held and the lowest that did not
until they are within `resolution` (hi / lo - 1, rates) or adjacent (integer kinds).  Every
load it asks for lies strictly above every load that held and strictly below every one that
failed, so none is measured twice and the capacity, the highest load that held, is
within the resolution of the true one for a system whose latency rises with load.  Rate
midpoints are rounded to 3 significant digits so the levels stay readable.

The **knee** is the highest measured load whose percentile is at most twice that of the
lowest load measured.
"""
from __future__ import annotations

import math

KINDS = ("rate", "concurrency", "streams")
DEFAULT_CAP = {"rate": 1e6, "concurrency": 4096, "streams": 4096}
MAX_LEVELS = 10_000  # a range longer than this is surely a typo (e.g. a missing STEP)
UNIT = {"rate": "/s", "concurrency": " in flight", "streams": " streams"}


class RangeError(ValueError):
    """A load range that cannot be used, with a message fit for the command line."""


# -- ranges ---------------------------------------------------------------------------------


def _number(part: str, integer: bool, text: str) -> float | int:
    part = part.strip()
    try:
        value = int(part) if integer else float(part)
    except ValueError:
        what = "an integer" if integer else "a number"
        raise RangeError(f"range {text!r}: {part!r} is not {what}") from None
    if not math.isfinite(value):
        raise RangeError(f"range {text!r}: {part!r} is not finite")
    return value


def _parts(text: str, integer: bool) -> list[float | int]:
    parts = str(text).split(":")
    if len(parts) > 3:
        raise RangeError(f"range {text!r}: expected START:END[:STEP] or a single value")
    values = [_number(p, integer, text) for p in parts]
    for name, v in zip(("START", "END"), values[:2]):
        if integer and v < 1:
            raise RangeError(f"range {text!r}: {name} must be an integer >= 1, got {v}")
        if not integer and v <= 0:
            raise RangeError(f"range {text!r}: {name} must be > 0, got {v:g}")
    if len(values) >= 2 and values[0] > values[1]:
        raise RangeError(f"range {text!r}: START {values[0]:g} is greater than END {values[1]:g}")
    return values


def expand_range(text: str, integer: bool) -> list[float | int]:
    """`"START:END[:STEP]"` (END inclusive) or `"V"` as the list of levels; ints if `integer`."""
    values = _parts(text, integer)
    if len(values) == 1:
        return values
    start, end = values[0], values[1]
    step = values[2] if len(values) == 3 else 1
    if step <= 0:
        raise RangeError(f"range {text!r}: STEP must be > 0, got {step:g}")
    if integer:
        count = (end - start) // step + 1
    else:  # END counts when a step lands within 1e-9 (relative) of it
        count = math.floor((end * (1 + 1e-9) - start) / step) + 1
    if count > MAX_LEVELS:
        raise RangeError(f"range {text!r}: {count} levels (more than {MAX_LEVELS}); give a larger STEP")
    if integer:
        return list(range(start, end + 1, step))
    return [min(float(f"{start + i * step:.12g}"), end) for i in range(count)]


def parse_range_bounds(text: str, integer: bool) -> tuple[float | int, float | int | None]:
    """`--search`'s range: (START, END), END None when absent; a STEP is ignored."""
    values = _parts(text, integer)
    return values[0], (values[1] if len(values) >= 2 else None)


# -- the SLO rule ---------------------------------------------------------------------------


def _apart(value: float, limit: float, fmt) -> tuple[str, str]:
    """`value` and `limit` formatted with the fewest digits that still show value > limit."""
    for digits in range(1, 9):
        a, b = fmt(value, digits), fmt(limit, digits)
        if a != b:
            break
    return a, b


def _pct(x: float, digits: int) -> str:
    return f"{100 * x:.{digits}f}%"


def _ms(x: float, digits: int) -> str:
    s = f"{x:.{digits + 2}g}"
    return s if "e" not in s else f"{x:.{digits - 1}f}"


def _bad(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def evaluate(result: dict, cfg: dict) -> tuple[bool, str | None]:
    """(holds, why_not) for one measured level (a report "results" entry)."""
    if not result.get("valid", True):
        reason = result.get("invalid_reason")
        return False, f"invalid: {reason}" if reason else "invalid"
    requests, errors = result.get("requests") or 0, result.get("errors") or 0
    if requests <= 0:
        return False, "no successful request"
    max_error_rate = cfg.get("max_error_rate", 0.001)
    rate = errors / (requests + errors)
    if rate > max_error_rate:
        a, b = _apart(rate, max_error_rate, _pct)
        return False, f"error rate {a} > {b}"
    slo, label = cfg["slo_ms"], f"p{cfg['percentile']:g}"
    windows = result.get("window_percentile_ms") or []
    if not windows:
        return False, "no window measured"
    for i, p in enumerate(windows, 1):
        if _bad(p):
            return False, f"window {i} {label} n/a (no successful request)"
        if p > slo:
            a, _ = _apart(p, slo, _ms)
            return False, f"window {i} {label} {a} ms > SLO {slo:g} ms"
    if result.get("mode") == "streams":
        max_drop_rate = cfg.get("max_drop_rate", 0.01)
        drop = (result.get("streams_detail") or {}).get("drop_rate")
        if _bad(drop):
            return False, "drop rate unknown"
        if drop > max_drop_rate:
            a, b = _apart(drop, max_drop_rate, _pct)
            return False, f"drop rate {a} > {b}"
    return True, None


# -- the search -----------------------------------------------------------------------------


def _between(lo: float, hi: float) -> float | None:
    """The midpoint of (lo, hi) at 3 significant digits, more if needed to stay strictly inside."""
    mid = (lo + hi) / 2
    for digits in range(3, 16):
        r = float(f"{mid:.{digits}g}")
        if lo < r < hi:
            return r
    return None


def _fmt(load) -> str:
    return f"{load:.12g}"


class Search:
    """Doubling then bisection towards the highest load that holds (module docstring)."""

    def __init__(self, kind: str, start, cap=None, resolution: float = 0.05):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.integer = kind, kind != "rate"
        cap = DEFAULT_CAP[kind] if cap is None else cap
        if self.integer:
            if int(start) != start or int(cap) != cap:
                raise ValueError(f"{kind} search loads are integers, got start={start} cap={cap}")
            start, cap = int(start), int(cap)
        if not start > 0 or not resolution > 0:
            raise ValueError(f"start and resolution must be > 0, got {start} and {resolution}")
        if start > cap:
            raise ValueError(f"start {start} is above the cap {cap}")
        self.start, self.cap, self.resolution = start, cap, resolution
        self.steps: list[dict] = []
        self.done = False
        self._lo = None  # the highest load that held
        self._hi = None  # the lowest load that did not, once one failed
        self._next = start

    @property
    def capacity(self):
        return self._lo

    def next_load(self):
        return None if self.done else self._next

    def record(self, load, holds: bool, percentile_ms=None, throughput_rps=None, why_not=None) -> None:
        if self.done:
            raise RuntimeError("the search is done")
        if load != self._next:
            raise ValueError(f"expected a result for load {_fmt(self._next)}, got {_fmt(load)}")
        self.steps.append({"load": load, "holds": bool(holds), "percentile_ms": percentile_ms,
                           "throughput_rps": throughput_rps, "why_not": None if holds else why_not})
        if holds:
            self._lo = load
        else:
            self._hi = load
        self._next = self._choose()
        self.done = self._next is None

    def _choose(self):
        lo, hi = self._lo, self._hi
        if lo is None:  # START failed
            return None
        if hi is None:  # still doubling
            return None if lo >= self.cap else min(2 * lo, self.cap)
        if self.integer:
            return None if hi - lo <= 1 else (lo + hi) // 2
        return None if hi / lo - 1 <= self.resolution else _between(lo, hi)

    def describe(self) -> str:
        parts = [f"{_fmt(s['load'])} ok" if s["holds"] else
                 f"{_fmt(s['load'])} FAIL" + (f" ({s['why_not']})" if s["why_not"] else "")
                 for s in self.steps]
        if not self.done:
            end = "searching"
        elif self.capacity is None:
            end = f"no capacity (start {_fmt(self.start)} did not hold)"
        else:
            end = f"capacity {_fmt(self.capacity)}{UNIT[self.kind]}"
            if self.capacity == self.cap:
                end += " (the cap)"
        return "search: " + ", ".join(parts) + " -> " + end


# -- the report's "search" object -----------------------------------------------------------


def knee(points):
    """The highest load whose percentile is at most 2x the percentile at the lowest load."""
    points = [(load, p) for load, p in points if not _bad(p)]
    if not points:
        return None
    base = min(points, key=lambda lp: lp[0])[1]
    return max(load for load, p in points if p <= 2 * base)


def summary(results: list[dict], cfg: dict, kind: str, searched: bool, steps: list[dict] | None = None) -> dict:
    """The report's "search" object for the levels measured (and the search's steps, if any)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if steps is None:
        steps = [{"load": r["load"], "holds": bool(r["holds_slo"]), "percentile_ms": r.get("percentile_ms"),
                  "throughput_rps": r.get("throughput_rps"), "why_not": r.get("why_not")} for r in results]
    else:
        steps = [dict(s) for s in steps]
    # The highest level that held below the lowest that did not (perf_analyzer stops at the
    # first level over its threshold): a level that held above a failure is luck, not capacity.
    # The search only ever measures between the two, so there it is the highest that held.
    failed = [s["load"] for s in steps if not s["holds"]]
    ceiling = min(failed) if failed else math.inf
    held = [s["load"] for s in steps if s["holds"] and s["load"] < ceiling]
    capacity = max(held) if held else None
    # What stopped it: the service, or the load generator (the lowest failing level was
    # invalid because the generator could not keep the schedule): then the capacity is a
    # lower bound of the service's, and says so.
    limited_by = None
    if failed:
        first_fail = next(s for s in steps if not s["holds"] and s["load"] == ceiling)
        limited_by = "generator" if str(first_fail.get("why_not") or "").startswith("invalid") else "slo"
    at = {r["load"]: r for r in results}  # the last result measured at each load
    throughput = stream_equivalents = None
    if capacity is not None:
        step = next(s for s in steps if s["holds"] and s["load"] == capacity)
        throughput = at.get(capacity, step).get("throughput_rps")
    if kind == "streams":
        def equivalents(r):
            return (r.get("streams_detail") or {}).get("stream_equivalents")
        if capacity is not None:
            stream_equivalents = equivalents(at[capacity]) if capacity in at else None
        else:  # the fractional figure: the best any level managed
            figures = [e for e in map(equivalents, results) if not _bad(e)]
            stream_equivalents = max(figures) if figures else None
    return {
        "searched": bool(searched), "kind": kind,
        "slo_ms": cfg.get("slo_ms"), "percentile": cfg.get("percentile"),
        "steps": steps,
        "capacity": capacity, "capacity_throughput_rps": throughput,
        "limited_by": limited_by,  # "slo" | "generator" | None (no level failed: the cap or the range's end)
        "stream_equivalents": stream_equivalents,
        "knee": knee([(r["load"], r.get("percentile_ms")) for r in results]),
    }
