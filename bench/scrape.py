"""Read a broker's Prometheus endpoint (`python -m broker --http HOST:PORT`, /metrics) around
a load level of `bench run`: what the broker itself counted for one service over that level.

Counters and histograms only grow, so a level's figures are the difference of two scrapes
(one as its first measured window starts, one just after its last): requests by outcome,
and the means of the queue-wait, request, compute and batch-size histograms (sum / count).
Parsing is prometheus-client's own text parser.

The first scrape marks a level's start, so it must reach the broker at that moment: a
`Scraper` builds its URL opener once, up front.  (`urllib.request.urlopen` builds one on
its first call, and since Python 3.12 that builds an HTTPS handler whose default SSL context
loads the system's CA certificates, 30-60 ms on a busy 2-core host: the start scrape then
reached the broker that late, and the requests completed meanwhile, 6-10 at 200 req/s, were
counted before the level instead of in it.)"""
from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# histogram family -> (report key, factor to the report's unit)
HISTOGRAMS = {
    "zmq_infer_queue_wait_seconds": ("queue_wait_ms_mean", 1e3),
    "zmq_infer_request_seconds": ("request_ms_mean", 1e3),
    "zmq_infer_compute_seconds": ("compute_ms_mean", 1e3),
    "zmq_infer_input_seconds": ("input_ms_mean", 1e3),
    "zmq_infer_output_seconds": ("output_ms_mean", 1e3),
    "zmq_infer_batch_size": ("batch_size_mean", 1.0),
}
REQUESTS = "zmq_infer_requests"  # the family name the parser gives zmq_infer_requests_total


class ScrapeError(RuntimeError):
    """The metrics endpoint could not be read or parsed."""


def fetch(url: str, timeout_s: float = 5.0, opener: urllib.request.OpenerDirector | None = None) -> str:
    """The body at `url`, through `opener` (built ahead: `Scraper`), else urlopen's own."""
    try:
        with (opener.open if opener is not None else urllib.request.urlopen)(url, timeout=timeout_s) as r:
            return r.read().decode("utf-8", "replace")
    except (OSError, ValueError) as e:
        raise ScrapeError(f"cannot read {url}: {e}") from None


def snapshot(text: str, service: str) -> dict[str, float]:
    """The service's cumulative series as flat keys: 'requests:<outcome>', '<family>:sum',
    '<family>:count'."""
    out: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError and friends on junk
        raise ScrapeError(f"cannot parse the metrics text: {e}") from None
    for fam in families:
        for s in fam.samples:
            if s.labels.get("service") != service:
                continue
            if fam.name == REQUESTS and s.name.endswith("_total"):
                key = f"requests:{s.labels.get('outcome', '?')}"
                out[key] = out.get(key, 0.0) + s.value
            elif fam.name in HISTOGRAMS and s.name in (fam.name + "_sum", fam.name + "_count"):
                key = f"{fam.name}:{s.name.rsplit('_', 1)[1]}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def level_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The report's `server_metrics` for one level, from the scrapes around it."""
    def delta(k: str) -> float:
        return after.get(k, 0.0) - before.get(k, 0.0)

    requests = {k.split(":", 1)[1]: int(round(delta(k)))
                for k in sorted(set(before) | set(after)) if k.startswith("requests:")}
    fig: dict[str, Any] = {"requests": {k: v for k, v in requests.items() if v}}
    for fam, (key, factor) in HISTOGRAMS.items():
        n = delta(f"{fam}:count")
        fig[key] = round(delta(f"{fam}:sum") / n * factor, 4) if n > 0 else None
    return fig


class Scraper:
    """Scrapes `url` for `service`; `mark()` before a level, `figures()` after it."""

    def __init__(self, url: str, service: str, timeout_s: float = 5.0):
        self.url, self.service, self.timeout_s = url, service, timeout_s
        self._before: dict[str, float] | None = None
        # Built now, not on a level's edge (the module docstring); the same handlers as
        # urlopen's (proxies from the environment, redirects, https).
        self._opener = urllib.request.build_opener()

    def scrape(self) -> dict[str, float]:
        return snapshot(self.fetch_text(), self.service)

    def fetch_text(self) -> str:
        return fetch(self.url, self.timeout_s, self._opener)

    def figures_since(self, before_text: str | None) -> dict[str, Any]:
        """The level's figures from the text fetched at its start (parsed only now)."""
        before = snapshot(before_text, self.service) if before_text else {}
        return level_figures(before, self.scrape())

    def mark(self) -> None:
        self._before = self.scrape()

    def figures(self) -> dict[str, Any]:
        before, self._before = self._before or {}, None
        return level_figures(before, self.scrape())
