"""Crash cleanup: unlink segments whose owner process is gone.

A segment's name carries its owner's pid *and* start time, so "is the owner alive?" is
one read of /proc/<pid>/stat, and a recycled pid (same number, later start time) is seen
as the different process it is.  Only the owner unlinks a segment while it lives; after it
dies anyone may, and every new ShmPool does so once per process.

Unlinking only removes the name: processes that still map the segment keep valid memory
until they drop their mappings (SegmentCache.sweep()), and the kernel frees the pages then.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from .segment import (
    FREE, HEADER_DTYPE, MAGIC, SHM_DIR, SLOT_DTYPE, SLOT_SIZE, HEADER_SIZE, parse_name,
    mark_closed, pid_namespace, process_alive,
)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class SegmentInfo(NamedTuple):
    name: str
    owner_pid: int
    owner_starttime: int
    alive: bool
    size: int  # file size in bytes
    live_slots: int | None  # non-FREE slots, None if the header is unreadable
    foreign: bool  # header names another pid namespace: our /proc cannot judge it


def _header(fd: int):
    raw = os.pread(fd, HEADER_DTYPE.itemsize, 0)
    if len(raw) < HEADER_DTYPE.itemsize:
        return None
    h = np.frombuffer(raw, HEADER_DTYPE)[0]
    return h if bytes(h["magic"]) == MAGIC else None


def _inspect(name: str, ids: tuple[int, int], count_slots: bool) -> SegmentInfo | None:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        # Another user's segment (mode 0600) or a symlink: list it, judge nothing else.
        try:
            size = os.lstat(path).st_size
        except OSError:
            return None
        return SegmentInfo(name, ids[0], ids[1], process_alive(*ids), size, None, False)
    try:
        size = os.fstat(fd).st_size
        h = _header(fd)
        live = None
        foreign = False
        if h is not None:
            ns = int(h["owner_pidns"])
            mine = pid_namespace()
            foreign = bool(ns and mine and ns != mine)
            if count_slots:
                slots = int(h["slot_count"])
                tab = os.pread(fd, SLOT_SIZE * slots, HEADER_SIZE)
                if len(tab) == SLOT_SIZE * slots:
                    live = int(np.count_nonzero(np.frombuffer(tab, SLOT_DTYPE)["state"] != FREE))
    finally:
        os.close(fd)
    return SegmentInfo(name, ids[0], ids[1], process_alive(*ids), size, live, foreign)


def list_segments(count_slots: bool = True) -> list[SegmentInfo]:
    """Every zinf-* segment in /dev/shm with its owner and whether the owner is alive."""
    out = []
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return out
    for name in names:
        ids = parse_name(name)
        if ids is None:
            continue
        info = _inspect(name, ids, count_slots)
        if info is not None:
            out.append(info)
    return out


def _mark_closed(path: str) -> None:
    """Set the header's closed flag so readers holding a cached mapping let go of it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | _NOFOLLOW)
    except OSError:
        return
    try:
        if _header(fd) is not None:
            mark_closed(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def collect(dry_run: bool = False) -> list[str]:
    """Unlink every zinf-* segment whose owner (pid + start time) is gone; their names.

    With ``dry_run`` nothing is touched and the names that would go are returned.
    Segments whose header names another pid namespace are left alone: a pid there means
    nothing here.
    """
    removed = []
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:  # pragma: no cover
        return removed
    for name in names:
        ids = parse_name(name)
        if ids is None or process_alive(*ids):
            continue
        info = _inspect(name, ids, count_slots=False)
        if info is None or info.foreign or info.alive:
            continue
        if dry_run:
            removed.append(name)
            continue
        path = os.path.join(SHM_DIR, name)
        _mark_closed(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue  # another collector got there first
        except OSError:
            continue  # not ours to remove (another user's, in a sticky /dev/shm)
        removed.append(name)
    return removed


__all__ = ["collect", "list_segments", "SegmentInfo"]
