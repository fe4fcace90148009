"""Inspection and cleanup of segments.

Segments are sealed memfds (docs/shm.md): they have no name in any filesystem, and the
kernel frees one when its owner's descriptor and the last mapping are gone, so a crashed
owner leaves nothing behind to collect.  What this module does:

- `list_segments()`: every live segment this process can see, found through the owners'
  ``/proc/<pid>/fd`` (only processes of the same user are visible there), with its size
  and the number of slots in use.
- `collect()`: unlink the ``/dev/shm/zinf-*`` files that earlier versions created and whose
  owner (pid + start time, from the name) is gone.  Nothing of this version ever needs it.
"""
from __future__ import annotations

import os
from typing import NamedTuple

# Names only at import: `collect` (which a broker runs) reads no header unless a legacy file
# is there, and `shm.segment` (the layout) brings numpy; the functions that read headers
# import it.
from .names import LEGACY_NAME_RE, NAME_RE, PREFIX, SHM_DIR, pid_namespace, process_alive

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_LINK_HEAD = "/memfd:" + PREFIX
_LINK_TAIL = " (deleted)"


class SegmentInfo(NamedTuple):
    name: str
    owner_pid: int
    owner_starttime: int
    alive: bool
    size: int  # file size in bytes
    live_slots: int | None  # non-FREE slots, None if the header is unreadable
    foreign: bool  # header names another pid namespace: our /proc cannot judge it


def _header(fd: int):
    import numpy as np

    from .segment import HEADER_DTYPE, MAGIC

    raw = os.pread(fd, HEADER_DTYPE.itemsize, 0)
    if len(raw) < HEADER_DTYPE.itemsize:
        return None
    h = np.frombuffer(raw, HEADER_DTYPE)[0]
    return h if bytes(h["magic"]) == MAGIC else None


def _live_slots(fd: int, h, size: int) -> int | None:
    """Slots not FREE, or None when the header's count does not fit the file (any process
    of the user may make a memfd with our label and a header of its choosing)."""
    import numpy as np

    from .segment import FREE, HEADER_SIZE, MAX_SLOTS, SLOT_DTYPE, SLOT_SIZE

    slots = int(h["slot_count"])
    if not 0 < slots <= MAX_SLOTS or HEADER_SIZE + SLOT_SIZE * slots > size:
        return None
    tab = os.pread(fd, SLOT_SIZE * slots, HEADER_SIZE)
    if len(tab) != SLOT_SIZE * slots:
        return None
    return int(np.count_nonzero(np.frombuffer(tab, SLOT_DTYPE)["state"] != FREE))


def _segments_of(pid: str) -> list[str]:
    """Names of the segments process ``pid`` owns, from the links in its fd table."""
    d = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(d)
    except OSError:  # gone, or another user's
        return []
    seen: dict[str, str] = {}
    for fd in sorted(fds, key=int):
        try:
            target = os.readlink(f"{d}/{fd}")
        except OSError:
            continue
        if not (target.startswith(_LINK_HEAD) and target.endswith(_LINK_TAIL)):
            continue
        label = target[len("/memfd:"): -len(_LINK_TAIL)]
        name = f"{label}-{fd}"
        m = NAME_RE.fullmatch(name)
        # Only the owner's fd table names its segments (a forked child's inherited copy
        # would list them twice); each mapping holds a duplicate of the descriptor
        # (Python's mmap keeps one), so one segment may appear under several numbers:
        # the lowest is the one the owner made, or the one left once it closed that.
        if m is not None and m.group(1) == pid and label not in seen:
            seen[label] = name
    return list(seen.values())


def list_segments(count_slots: bool = True) -> list[SegmentInfo]:
    """Every live segment whose owner this process can see (the same user's processes)."""
    out = []
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # pragma: no cover - no /proc
        return out
    for pid in sorted(pids, key=int):
        for name in _segments_of(pid):
            m = NAME_RE.fullmatch(name)
            try:
                fd = os.open(f"/proc/{pid}/fd/{m.group(4)}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                h = _header(fd)
                live = _live_slots(fd, h, size) if h is not None and count_slots else None
            except OSError:
                continue
            finally:
                os.close(fd)
            out.append(SegmentInfo(name, int(m.group(1)), int(m.group(2)), True, size, live, False))
    return out


def _inspect_legacy(name: str, dry_run: bool) -> bool:
    """True when a legacy /dev/shm file may be removed: its header names our pid namespace.
    Unless ``dry_run``, its closed flag is set (readers holding a mapping let go of it)."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC | _NOFOLLOW)
    except OSError:
        return False  # another user's (mode 0600), or a symlink: not ours to judge
    try:
        h = _header(fd)
        if h is not None:
            ns = int(h["owner_pidns"])
            mine = pid_namespace()
            if ns and mine and ns != mine:
                return False
            if not dry_run:
                from .segment import mark_closed

                mark_closed(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def collect(dry_run: bool = False) -> list[str]:
    """Unlink every legacy ``/dev/shm/zinf-*`` file whose owner (pid + start time) is gone;
    their names.  With ``dry_run`` nothing is touched and the names that would go are
    returned.  Files whose header names another pid namespace are left alone."""
    removed = []
    try:
        with os.scandir(SHM_DIR) as it:
            entries = sorted(it, key=lambda e: e.name)
    except FileNotFoundError:  # pragma: no cover
        return removed
    euid = os.geteuid()
    for entry in entries:
        name = entry.name
        m = LEGACY_NAME_RE.fullmatch(name)
        if m is None:
            continue
        if euid:
            # Another user's file is not ours to judge, nor to remove (the kernel would refuse):
            # /dev/shm is anyone's to write, and 100,000 files planted there cost each pass of
            # an owner's /proc and an open 0.45 s (the shm audit).
            try:
                if entry.stat(follow_symlinks=False).st_uid != euid:
                    continue
            except OSError:
                continue
        if process_alive(int(m.group(1)), int(m.group(2))):
            continue
        if not _inspect_legacy(name, dry_run):
            continue
        if dry_run:
            removed.append(name)
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            continue  # another collector got there first, or not ours to remove
        removed.append(name)
    return removed


__all__ = ["collect", "list_segments", "SegmentInfo"]
