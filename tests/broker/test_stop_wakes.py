"""A stop set from a signal handler ends the broker's wait at once (`_SignalStop.wake_fd`,
`Broker.serve`): the interpreter runs the handler only once the wait returns, so it was
seen at the end of the wait, up to 100 ms later.  Deterministic: the loop's waits are made
endless, so only the descriptor can end one."""
from __future__ import annotations

import os
import threading

import zmq

from broker.protocol import wire
from broker.server import Broker, BrokerConfig


class _PipeStop:
    """A stop whose ``set`` writes to a pipe, as the C-level signal handler writes to
    python -m broker's (`signal.set_wakeup_fd`)."""

    def __init__(self):
        self.wake_fd, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._set = False

    def set(self):
        self._set = True
        os.write(self._w, b"\x0f")

    def is_set(self):
        return self._set

    def close(self):
        os.close(self.wake_fd)
        os.close(self._w)


def test_a_stop_with_a_wake_fd_ends_the_brokers_wait_at_once(tmp_path, monkeypatch):
    real_wait = wire.Waiter.wait
    waits = []
    waiting = threading.Event()

    def endless(self, ms):  # every wait without a limit: only a descriptor ends it
        waits.append(ms)
        waiting.set()
        return real_wait(self, -1)

    monkeypatch.setattr(wire.Waiter, "wait", endless)
    stop = _PipeStop()
    broker = Broker(BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc"),
                    ctx=zmq.Context.instance())
    t = threading.Thread(target=broker.serve, args=(stop,), daemon=True)
    try:
        t.start()
        # Set once the loop waits (set before its first pass, the loop never ran: "never waited").
        assert waiting.wait(10), "the broker's loop never began to wait"
        stop.set()
        t.join(10)
        assert not t.is_alive(), "the broker's wait did not end when its stop was set: it sees only its timeout"
    finally:
        if t.is_alive():  # (failed: end the wait another way, so that nothing is left behind)
            with zmq.Context.instance().socket(zmq.DEALER) as s:
                s.linger = 0
                s.connect(f"ipc://{tmp_path}/fe.ipc")
                s.send_multipart([b"", b"MDPC02", b"\x01", b"mmi.service", b"x"])
                t.join(10)
        broker.close()
        stop.close()
    assert waits, "the loop never waited"


def test_python_m_brokers_stop_listens_on_a_pipe_the_signals_write_to():
    """The wiring: `_SignalStop.listen()` makes the interpreter's signal wake-up write to its
    pipe (main thread only), and `close()` takes that back."""
    import signal

    from broker.__main__ import _SignalStop

    stop = _SignalStop()
    stop.listen()
    try:
        assert stop.wake_fd is not None
        old = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(old)
        assert old == stop._write_fd
    finally:
        stop.close()
    assert stop.wake_fd is None and signal.set_wakeup_fd(-1) == -1
