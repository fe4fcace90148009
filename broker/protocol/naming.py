"""Names every process must agree on: the host identity, the runtime directory, the default
endpoints, and the file names of direct-reply sockets.

A client, a worker and the broker each compute these alone; they meet only because the rules
here are the same for all three.  Nothing here opens a socket.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
import socket
import tempfile

from shm.segment import self_identity

__all__ = [
    "local_host_id", "default_runtime_dir", "default_endpoints", "reply_socket_path",
    "parse_reply_socket_name",
]

# Host identity: two processes may exchange shm references only if they see the same /dev/shm.

@functools.lru_cache(maxsize=1)
def local_host_id() -> str:
    """Identity of this process's shared-memory domain: same boot, same /dev/shm mount.

    The hostname alone is not enough (containers share it but not /dev/shm; a reboot keeps it
    but empties /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # pragma: no cover - non-Linux
        boot = "noboot"
    try:
        st = os.stat("/dev/shm")
        mount = f"{st.st_dev}:{st.st_ino}"
    except OSError:  # pragma: no cover
        mount = "noshm"
    digest = hashlib.blake2s(f"{boot}/{mount}".encode(), digest_size=8).hexdigest()
    return f"{socket.gethostname()}/{digest}"


def default_runtime_dir() -> str:
    """`$XDG_RUNTIME_DIR/zmq-infer-<uid>` (or under the temp dir), created 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(base, f"zmq-infer-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def default_endpoints() -> tuple[str, str]:
    """The broker's frontend and backend endpoints when none is configured."""
    d = default_runtime_dir()
    return f"ipc://{d}/frontend.ipc", f"ipc://{d}/backend.ipc"


# A client's direct-reply socket (docs/protocol.md section 8): c-<pid>-<starttime>-<hex>.ipc
# in the runtime directory, named like shared-memory segments so that a dead owner is told
# from a live one even after its pid is reused.
_REPLY_SOCKET_RE = re.compile(r"c-(\d+)-(\d+)-[0-9a-f]+\.ipc")


def reply_socket_path() -> str:
    """A fresh path for this process's direct-reply socket."""
    pid, start = self_identity()
    return os.path.join(default_runtime_dir(), f"c-{pid}-{start}-{secrets.token_hex(6)}.ipc")


def parse_reply_socket_name(name: str) -> tuple[int, int] | None:
    """(pid, starttime) of the client that owns a reply-socket file name, or None if the name
    is not one."""
    m = _REPLY_SOCKET_RE.fullmatch(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)))
