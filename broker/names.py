"""The service names a broker remembers (for labels and for 404 against 503), bounded and
retired: see `ServiceNames`.  Pure: no clock, no socket.
"""
from __future__ import annotations

__all__ = ["ServiceNames", "RETAIN_S", "MAX_SERVICES"]

MAX_SERVICES = 1024
RETAIN_S = 600.0  # a service with no live worker for this long is forgotten (ServiceNames.sweep)
EVICT_AFTER_S = 60.0  # ... and one without for this long may make room for a newcomer when full


class ServiceNames:
    """The service names some worker registered, at most ``cap``, each forgotten once it has
    had no live worker for ``retain`` seconds (`sweep`, once a second), and the one without
    one for longest making room for a newcomer when full.  Without either, a deployment that
    starts and retires services (a name per model version, per tenant) filled the list with
    the dead for good: a new service got no label of its own (counted under ``_other``) and
    a 404 for its readiness, and every scrape rendered the dead.  Pure (no clock, no socket):
    the broker passes ``now`` and whether a name has a live worker."""

    def __init__(self, cap: int = MAX_SERVICES, retain: float = RETAIN_S, evict_after: float = EVICT_AFTER_S):
        self.cap = cap
        self.retain = retain
        self.evict_after = evict_after
        self.names: dict[str, None] = {}
        self.dead_since: dict[str, float] = {}  # names without a live worker: since when

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def add(self, name: str, now: float) -> str | None:
        """``name`` has a live worker (it registered): known from now on.  Returns a name
        forgotten to make room for it, if one was: the one without a worker for longest,
        if for ``evict_after`` at least (one in a restart's backoff keeps its place)."""
        if name in self.names:
            self.dead_since.pop(name, None)
            return None
        gone = None
        if len(self.names) >= self.cap:
            if not self.dead_since:
                return None  # all live: the newcomer counts under _other
            gone = min(self.dead_since, key=self.dead_since.__getitem__)  # O(names), only when full
            if now - self.dead_since[gone] < self.evict_after:
                return None  # none dead long enough: the newcomer counts under _other meanwhile
            self.forget(gone)
        self.names[name] = None
        return gone

    def has_room(self, now: float) -> bool:
        """Whether `add` would take a new name now (O(names) when full: once a pass)."""
        if len(self.names) < self.cap:
            return True
        return bool(self.dead_since) and now - min(self.dead_since.values()) >= self.evict_after

    def forget(self, name: str) -> None:
        self.names.pop(name, None)
        self.dead_since.pop(name, None)

    def sweep(self, live, now: float) -> list[str]:
        """Once a second: note which names have nothing (``live(name)`` false: no worker, no
        request waiting for one) since when, and forget those without for ``retain``
        seconds; the names forgotten."""
        dead = self.dead_since
        gone = []
        for name in self.names:
            if live(name):
                if dead:
                    dead.pop(name, None)
            else:
                since = dead.setdefault(name, now)
                if now - since >= self.retain:
                    gone.append(name)
        for name in gone:
            self.forget(name)
        return gone
