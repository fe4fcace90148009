"""broker.protocol.limits.Headroom, the decision to stop and start accepting connections
near the descriptor limit (libzmq's ipc listener aborts the process at EMFILE), with a
counted descriptor total instead of the process's."""
from __future__ import annotations

from broker.protocol.limits import Headroom, open_descriptors


def test_it_pauses_at_the_reserve_and_resumes_below_twice_it():
    fds = {"n": 20}
    h = Headroom(100, count=lambda: fds["n"], reserve=16)  # pause at 84, resume below 68
    listed = []
    real = h.count
    h.count = lambda: listed.append(1) or real()
    for _ in range(63):
        fds["n"] += 1
        assert h.accepted() is False
    assert not listed  # far from the limit: counted, not listed
    fds["n"] += 1
    assert h.accepted() is True and h.paused and h.used == 84
    fds["n"] += 3  # accepted meanwhile, within the reserve
    assert h.accepted(3) is False  # paused already
    fds["n"] = 70
    assert h.tick() is False  # not below 68 yet
    fds["n"] = 60
    assert h.tick() is True and not h.paused
    assert h.tick() is False  # nothing to do while accepting


def test_connections_that_closed_are_found_when_it_lists_again():
    fds = {"n": 83}
    h = Headroom(100, count=lambda: fds["n"], reserve=16)
    fds["n"] = 30  # many closed since: the estimate (83, then 84: the mark) is stale
    assert h.accepted() is False and h.used == 30  # listed at the mark, and it is far from it


def test_a_process_that_cannot_list_its_descriptors_is_taken_as_full():
    fds = {"n": 10}
    h = Headroom(64, count=lambda: fds["n"], reserve=16)
    h.used = 48
    fds["n"] = -1  # EMFILE: cannot even open /proc/self/fd
    assert h.accepted() is True and h.paused
    assert h.tick() is False  # still cannot tell: stays paused
    fds["n"] = 12
    assert h.tick() is True


def test_the_reserve_scales_with_the_limit_and_the_count_is_real():
    from broker.protocol.limits import listen_backlog

    # A third of a low limit (a burst accepted before the pause must fit), an eighth of a high one.
    assert Headroom(32, count=lambda: 0).reserve == 16
    assert Headroom(64, count=lambda: 0).reserve == 21
    assert Headroom(256, count=lambda: 0).reserve == 85
    assert Headroom(1024, count=lambda: 0).reserve == 256
    assert Headroom(4096, count=lambda: 0).reserve == 512
    assert [listen_backlog(r) for r in (16, 85, 256, 1024)] == [8, 42, 100, 100]
    assert Headroom(1 << 20, count=lambda: 0).reserve == 1024
    assert open_descriptors() > 2
