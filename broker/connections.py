"""Which worker each backend connection carries, so that a closed connection is a dead worker
at once instead of after `heartbeat_liveness` silent intervals.

The broker learns a worker's connection from its READY (the file descriptor libzmq read it
from) and a closed connection from the backend socket's monitor (EVENT_DISCONNECTED, with the
same descriptor).  Pure bookkeeping: no socket, no clock; the server feeds it and acts on
what it returns.

The one subtlety is descriptor reuse.  The kernel may give a closed connection's number to a
new one, and the monitor event for the old connection travels on another socket than the
new worker's READY, so the two can arrive in either order:

- event first: the descriptor is forgotten, the READY then binds it afresh;
- READY first: the descriptor still names the old worker, which therefore has lost its
  connection: it is reported dead now, and the event still owed for it is ignored when it
  comes (`_owed`).

So each connection's single DISCONNECTED event removes exactly the worker it carried.  An
entry lives as long as its connection, whatever happened to the worker meanwhile (a
DISCONNECT, an expiry): only the event says the number is free again.
"""
from __future__ import annotations

__all__ = ["WorkerConnections"]


class WorkerConnections:
    def __init__(self) -> None:
        self._by_fd: dict[int, bytes] = {}
        self._fd_of: dict[bytes, int] = {}
        self._owed: dict[int, int] = {}  # fd -> DISCONNECTED events of replaced connections still to come

    def bind(self, fd: int, worker: bytes) -> bytes | None:
        """`worker` said READY on connection `fd`.  Returns the worker that connection number
        used to carry, now known to be gone, if any."""
        old_fd = self._fd_of.pop(worker, None)
        if old_fd is not None and old_fd != fd:
            self._by_fd.pop(old_fd, None)
        gone = self._by_fd.get(fd)
        if gone is not None and gone != worker:
            self._fd_of.pop(gone, None)
            self._owed[fd] = self._owed.get(fd, 0) + 1
        else:
            gone = None
        self._by_fd[fd] = worker
        self._fd_of[worker] = fd
        return gone

    def closed(self, fd: int) -> bytes | None:
        """Connection `fd` closed: the worker it carried (to presume dead), or None."""
        owed = self._owed.get(fd, 0)
        if owed:
            if owed == 1:
                del self._owed[fd]
            else:
                self._owed[fd] = owed - 1
            return None
        worker = self._by_fd.pop(fd, None)
        if worker is not None:
            self._fd_of.pop(worker, None)
        return worker

    def fd_of(self, worker: bytes) -> int | None:
        """The connection `worker` said READY on, if still open."""
        return self._fd_of.get(worker)

    def __len__(self) -> int:
        return len(self._by_fd)
