"""`compare --blocking` / `--both` end to end: real floor peers measured through their blocking
clients and reported as `PEER:sync` with the `_sync` ratios; a peer without a blocking client
is skipped for that variant with the reason; concurrency other than 1 is a usage error."""
from __future__ import annotations

import json

from bench import __main__ as cli
from bench.peers import PEERS
from bench.report import SYNC_RATIOS, TAIL_RATIOS

from tests.bench.test_report_cli import RESULT_KEYS, fake_peer

SHORT = ["--window-s", "0.1", "--warmup-s", "0", "--max-duration-s", "2", "--quiet"]


def test_compare_blocking_with_real_floor_peers(tmp_path):
    out = tmp_path / "b.json"
    rc = cli.main(["compare", "--blocking", "--peers", "direct,proxy", "--sizes", "16",
                   "--json", str(out), *SHORT])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["clients"] == "blocking"
    assert list(rep["peers"]) == ["direct", "direct:sync", "proxy", "proxy:sync"]
    assert {r["peer"] for r in rep["results"]} == {"direct:sync", "proxy:sync"}
    for r in rep["results"]:
        assert set(r) == RESULT_KEYS | {"blocking"} and r["blocking"] is True
        assert r["requests"] > 0 and r["errors"] == 0 and r["concurrency"] == 1
        assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    assert set(SYNC_RATIOS) | set(TAIL_RATIOS) <= set(rep["ratios"])
    assert set(rep["ratios"]) == set(rep["ratio_definitions"])
    # Only the direct and proxy floors ran: the ratio between them is there, the rest say why.
    assert rep["ratios"]["broker_vs_direct_tiny_sync"] is None
    assert "broker-shm:sync" in rep["ratios_missing"]["broker_vs_direct_tiny_sync"]
    # The asyncio ratios stay in the report, null: only the blocking clients were measured.
    assert rep["ratios"]["broker_vs_bare_proxy_tiny"] is None
    assert "only the blocking client of 'proxy'" in rep["ratios_missing"]["broker_vs_bare_proxy_tiny"]


def test_both_skips_the_blocking_variant_of_a_peer_without_one(tmp_path, monkeypatch):
    monkeypatch.setitem(PEERS, "fake-a", fake_peer("fake-a", 1.0))  # asyncio request only
    out = tmp_path / "f.json"
    rc = cli.main(["quick", "--both", "--peers", "fake-a", "--sizes", "16", "--json", str(out),
                   "--window-s", "0.04", "--warmup-s", "0", "--max-duration-s", "0.2", "--quiet"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["clients"] == "both"
    assert [r["peer"] for r in rep["results"]] == ["fake-a"]
    assert rep["peers"]["fake-a:sync"]["status"] == "skipped"
    assert "request_sync" in rep["peers"]["fake-a:sync"]["reason"]
    assert any(s["peer"] == "fake-a:sync" for s in rep["skipped"])
    assert "tail_ratio_tiny" in rep["ratios"] and rep["ratios"]["tail_ratio_tiny"] is None


def test_blocking_needs_concurrency_one_and_a_closed_loop(capsys):
    assert cli.main(["compare", "--blocking", "--concurrency", "2", "--peers", "direct"]) == 2
    assert "concurrency must be 1" in capsys.readouterr().err
    assert cli.main(["quick", "--both", "--rate", "100", "--peers", "direct"]) == 2
    assert cli.main(["sweep", "--blocking", "--concurrencies", "1,4", "--peers", "direct"]) == 2
    assert cli.main(["latency", "--both", "--concurrency", "3", "--peers", "direct"]) == 2
