"""broker.protocol.limits.memory_limit: the memory a process may use, read as the broker's
default broker-wide byte cap needs it (half of it: `--max-total-mb`).  Fake /proc and /sys
trees for cgroup v2, v1 in a container without a cgroup namespace (the review: its limit was
missed, and the host's memory taken), and none."""
from __future__ import annotations

import os

from broker.protocol.limits import memory_limit

MiB = 1 << 20


def _tree(tmp_path, cgroup: str, files: dict[str, str]):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    return str(tmp_path)


def _phys() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_cgroup_v2_limit(tmp_path):
    root = _tree(tmp_path, "0::/system.slice/broker.service\n",
                 {"sys/fs/cgroup/system.slice/broker.service/memory.max": str(512 * MiB)})
    assert memory_limit(root) == 512 * MiB


def test_cgroup_v2_without_a_limit_is_the_machines(tmp_path):
    root = _tree(tmp_path, "0::/user.slice\n", {"sys/fs/cgroup/user.slice/memory.max": "max"})
    assert memory_limit(root) == _phys()


def test_cgroup_v1_in_a_container_finds_its_own_mount(tmp_path):
    # /proc/self/cgroup names the host's path; the container sees its cgroup at the mount's root.
    root = _tree(tmp_path, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n",
                 {"sys/fs/cgroup/memory/memory.limit_in_bytes": str(300 * MiB)})
    assert memory_limit(root) == 300 * MiB


def test_cgroup_v1_unlimited_is_the_machines(tmp_path):
    root = _tree(tmp_path, "4:memory:/\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"})
    assert memory_limit(root) == _phys()


def test_no_cgroup_file_is_the_machines(tmp_path):
    assert memory_limit(str(tmp_path)) == _phys()


def test_the_brokers_default_caps_fit_its_memory(monkeypatch):
    # The memory audit: in a 512 MiB cgroup the request cap was max(--max-client-mb, half)
    # = 512 MiB, all of it, and one client's queued requests got the broker OOM-killed; and
    # nothing bounded all clients' unread replies together.  Half for requests, a quarter
    # for unread replies, whatever the per-client cap.
    from broker import server

    monkeypatch.setattr(server, "memory_limit", lambda: 512 << 20)
    assert server.default_total_bytes() == 256 << 20
    assert server.default_unread_bytes() == 128 << 20
    monkeypatch.setattr(server, "memory_limit", lambda: None)
    assert server.default_total_bytes() == 1 << 50 and server.default_unread_bytes() is None
