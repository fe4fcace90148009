"""The in-process upstream of the worker tests (pair_link.PairLink) binds a name of its own."""
from __future__ import annotations

from tests.gpu_worker.pair_link import PairLink


def test_a_name_given_twice_binds_twice():
    # Tests name links after id(tmp_path), which a later test's tmp_path may reuse while
    # libzmq still holds the closed link's inproc name (its reaper thread frees it later):
    # a run on Python 3.12 under load failed a fixture's bind with "Address already in use".
    first = PairLink("same")
    first.close()
    links = [PairLink("same"), PairLink("same")]  # even while the first ones are open
    try:
        assert len({first.addr, *(link.addr for link in links)}) == 3
    finally:
        for link in links:
            link.close()
