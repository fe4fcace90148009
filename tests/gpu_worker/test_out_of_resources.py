"""A worker out of descriptors or memory answers the request it cannot read with an error
that says so (500, naming the resource), not with 400 "cannot read inputs ... this is a bug",
and serves the next request once it can.  In process, an inproc pair for the broker."""
from __future__ import annotations

import pytest

from broker import protocol as P
from shm.errors import OutOfResources
from tests.gpu_worker.test_recall import _finals, _settle, worker  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(30)


def test_inputs_it_cannot_map_for_want_of_descriptors_are_a_500_that_says_so(worker, monkeypatch):  # noqa: F811
    real = worker.plane.map_inputs

    def starved(job, rest):
        raise OutOfResources("cannot open segment zinf-1-2-0123456789abcdef-5: Too many open files")

    monkeypatch.setattr(worker.plane, "map_inputs", starved)
    seen: dict = {}

    def answered(token):
        seen.update(_finals(worker.up))  # (each read takes what was sent)
        return token in seen

    worker.up.request(1)
    _settle(worker, lambda: answered(1))
    rep = seen[1][0]
    assert rep.error.code == P.ErrorCode.INTERNAL
    assert "out of descriptors or memory" in rep.error.message and "Too many open files" in rep.error.message
    monkeypatch.setattr(worker.plane, "map_inputs", real)  # descriptors back: admitted
    worker.up.request(2)
    _settle(worker, lambda: P.token_envelope(2) in worker.jobs)
    assert 2 not in seen


def test_inputs_their_sender_closed_are_a_cancel_not_a_protocol_error(worker, monkeypatch):  # noqa: F811
    # A client that closes with requests queued at a worker closes their input segments: the
    # worker answered 400 and the broker counted each gateway shutdown as protocol errors
    # (found by the AR hunt).  Its own memory, closed by itself: a cancel (499).
    from shm.errors import SegmentGone

    def closed(job, rest):
        raise SegmentGone("segment zinf-1-2-0123456789abcdef-5 was closed by its owner")

    monkeypatch.setattr(worker.plane, "map_inputs", closed)
    seen: dict = {}

    def answered(token):
        seen.update(_finals(worker.up))
        return token in seen

    worker.up.request(1)
    _settle(worker, lambda: answered(1))
    rep = seen[1][0]
    assert rep.error.code == P.ErrorCode.CANCELLED and "closed by its owner" in rep.error.message
