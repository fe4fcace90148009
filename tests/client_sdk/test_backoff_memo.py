"""The client's per-service backoff memos stay bounded (the soak hunt: a long-lived pinned
client calling services that come and go kept an entry per name in `_pin_retry`,
`_pin_backoff`, `not_local` and `_not_local_backoff` for good)."""
from __future__ import annotations

from client_sdk.pins import BACKOFF_MEMO, PIN_RETRY_MAX_S, forget_stale


def test_a_full_memo_forgets_the_stale_then_the_oldest():
    retry, backoff = {}, {}
    now = 1000.0
    for i in range(BACKOFF_MEMO):
        retry[f"old{i}"], backoff[f"old{i}"] = now - 2 * PIN_RETRY_MAX_S, 30.0  # long past
    forget_stale(retry, backoff, now, PIN_RETRY_MAX_S)
    assert len(retry) == BACKOFF_MEMO  # not full: nothing looked at
    retry["new"], backoff["new"] = now + 4.0, 4.0
    forget_stale(retry, backoff, now, PIN_RETRY_MAX_S)
    assert retry == {"new": now + 4.0} and backoff == {"new": 4.0}  # the stale went, the live stayed
    for i in range(2 * BACKOFF_MEMO):  # all live: those whose time comes soonest go
        retry[f"live{i}"], backoff[f"live{i}"] = now + 1.0 + i % 30, 30.0
        forget_stale(retry, backoff, now, PIN_RETRY_MAX_S)
    assert len(retry) == len(backoff) == BACKOFF_MEMO
    everything = sorted(now + 1.0 + i % 30 for i in range(2 * BACKOFF_MEMO))
    assert sorted(retry.values()) == everything[-BACKOFF_MEMO:]  # the longest backoffs kept


def test_a_client_refused_leases_for_thousands_of_services_keeps_a_bounded_memo():
    from client_sdk.core import ClientCore

    core = ClientCore("ipc:///nonexistent.ipc", pin=True)
    try:
        now = 100.0
        for i in range(3000):
            core._pin_refused(f"model-v{i}", now)
            now += 0.1
        assert len(core._pin_retry) <= BACKOFF_MEMO and len(core._pin_backoff) <= BACKOFF_MEMO
        assert "model-v2999" in core._pin_retry  # the latest refusal still backs off
    finally:
        core.close()
