"""``python -m shm ls`` and ``python -m shm gc [--dry-run]``."""
from __future__ import annotations

import argparse
import sys

from .gc import collect, list_segments


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shm", description="Inspect zinf-* shared-memory segments (sealed memfds); remove files older versions left in /dev/shm.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list the live segments of this user's processes: name, owner pid, size, live slots")
    g = sub.add_parser("gc", help="unlink /dev/shm/zinf-* files of earlier versions whose owner process is gone")
    g.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    args = p.parse_args(argv)
    if args.cmd == "ls":
        rows = list_segments()
        print(f"{'NAME':<52} {'PID':>8} {'ALIVE':>6} {'SIZE':>10} {'LIVE SLOTS':>10}")
        for r in rows:
            alive = "?" if r.foreign else ("yes" if r.alive else "no")
            live = "?" if r.live_slots is None else str(r.live_slots)
            print(f"{r.name:<52} {r.owner_pid:>8} {alive:>6} {_size(r.size):>10} {live:>10}")
        if not rows:
            print("(no zinf-* segments)")
        return 0
    names = collect(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for n in names:
        print(f"{verb} {n}")
    print(f"{verb} {len(names)} legacy segment file(s) of dead owners")
    return 0


if __name__ == "__main__":
    sys.exit(main())
