"""WorkerConnections: closed connections name their worker exactly once, whatever the order of
a reused descriptor's READY and the old connection's DISCONNECTED event."""
from broker.connections import WorkerConnections


def test_a_closed_connection_names_its_worker_once():
    c = WorkerConnections()
    assert c.bind(7, b"w1") is None and c.bind(8, b"w2") is None
    assert c.closed(7) == b"w1" and c.closed(7) is None and len(c) == 1
    assert c.closed(99) is None  # a connection that never said READY


def test_reuse_with_the_event_first():
    c = WorkerConnections()
    c.bind(7, b"old")
    assert c.closed(7) == b"old"
    assert c.bind(7, b"new") is None
    assert c.closed(7) == b"new"


def test_reuse_with_the_ready_first():
    c = WorkerConnections()
    c.bind(7, b"old")
    assert c.bind(7, b"new") == b"old"  # its connection number is taken: old is gone
    assert c.closed(7) is None          # the old connection's late event: ignored
    assert c.closed(7) == b"new"        # the new connection's own event


def test_a_worker_moving_to_another_connection_keeps_one_entry():
    c = WorkerConnections()
    c.bind(7, b"w")
    assert c.bind(9, b"w") is None and len(c) == 1
    assert c.closed(7) is None and c.closed(9) == b"w"
