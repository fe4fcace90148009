"""Names every process must agree on: the host identity, the runtime directory, the default
endpoints, and the file names of direct-reply sockets.

A client, a worker and the broker each compute these alone; they meet only because the rules
here are the same for all three.  Nothing here opens a socket.
"""
from __future__ import annotations

import functools
import errno
import hashlib
import os
import re
import secrets
import socket
import stat
import tempfile

from broker.protocol.limits import paused_by
from shm.names import pid_exists, self_identity

__all__ = [
    "local_host_id", "default_runtime_dir", "RuntimeDirError", "default_endpoints", "reply_socket_path",
    "parse_reply_socket_name", "direct_socket_path", "tcp_port_problem", "endpoint_text_problem", "ipv6_for",
    "ipc_problem",
]

# Host identity: two processes may exchange shm references only if they see the same /dev/shm.

#: the inode of the host's initial pid namespace (the kernel's PROC_PID_INIT_INO, fixed)
_INIT_PID_NS = 0xEFFFFFFC


@functools.lru_cache(maxsize=1)
def local_host_id() -> str:
    """Identity of this process's shared-memory domain: same boot, same /dev/shm mount, same
    pid namespace.

    The hostname alone is not enough (containers share it but not /dev/shm; a reboot keeps it
    but empties /dev/shm).  Nor is /dev/shm: a reader opens the owner's memfd as
    `/proc/<pid>/fd/<fd>` by the pid the broker attested, which names the owner only within
    one pid namespace (a container sharing /dev/shm but not `--pid` is another domain, served
    inline)."""
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
    key = f"{boot}/{mount}"
    try:
        ino = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # pragma: no cover - no /proc
        ino = _INIT_PID_NS
    if ino != _INIT_PID_NS:
        # Only outside the host's own pid namespace, so that a host whose processes all run
        # in it keeps the identity versions before this one computed (a rolling upgrade of
        # such a host keeps its shared memory); inside containers it changed once.
        key = f"{key}/pidns:{ino}"
    digest = hashlib.blake2s(key.encode(), digest_size=8).hexdigest()
    return f"{socket.gethostname()}/{digest}"


class RuntimeDirError(PermissionError):
    """The runtime directory is not this user's own (another uid made it, or it is not a
    directory): its sockets could be reached, or faked, by someone else."""


def default_runtime_dir() -> str:
    """`$XDG_RUNTIME_DIR/zmq-infer-<uid>` (or under the temp dir), created 0700.

    The directory keeps other users away from the ipc sockets in it, so it must be ours: one
    that exists already is checked (through a descriptor opened without following a symlink)
    to be a directory owned by this uid, and set to 0700 if it is not.  Anything else
    raises `RuntimeDirError`: in a shared /tmp, another user could have created it first."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    if not os.path.isabs(base):
        raise RuntimeDirError(f"XDG_RUNTIME_DIR={base!r} is not an absolute path; set it to a directory of your own")
    uid = os.getuid()
    path = os.path.join(base, f"zmq-infer-{uid}")
    try:
        os.makedirs(base, exist_ok=True)
        try:
            os.mkdir(path, 0o700)  # (the umask may take bits off: set to 0700 below, through a descriptor)
        except FileExistsError:
            pass
    except UnicodeEncodeError:
        raise RuntimeDirError(f"XDG_RUNTIME_DIR={base!r} cannot be encoded for the file system in this locale; "
                              "set it to a path this locale can name") from None
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            raise  # nothing wrong with the directory (its advice would be wrong)
        # (XDG_RUNTIME_DIR a regular file, a read-only or full file system: a traceback
        # and exit 1, not one line: the command-line and environment hunts)
        raise RuntimeDirError(f"cannot make the runtime directory {path}: {e.strerror}; set XDG_RUNTIME_DIR to a "
                              f"directory of your own") from None
    try:
        # O_PATH: no read permission needed (a directory of ours at mode 000, as a umask of
        # 0777 makes it, was a traceback), and it follows no symlink.
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise  # out of descriptors, say: nothing wrong with the directory (its advice would be wrong)
        raise RuntimeDirError(f"runtime directory {path} is not a plain directory ({e.strerror}); remove it, "
                              f"or set XDG_RUNTIME_DIR to a directory of your own") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise RuntimeDirError(
                f"runtime directory {path} belongs to uid {st.st_uid}, not to this user (uid {uid}): another "
                f"user may have created it to reach or fake our sockets; remove it, or set XDG_RUNTIME_DIR "
                f"to a directory of your own")
        if st.st_mode & 0o777 != 0o700:
            # (whatever the umask made it: 0777 made it 000, 0177 0600: the environment hunt)
            os.chmod(f"/proc/self/fd/{fd}", 0o700)  # fchmod takes no O_PATH descriptor
    finally:
        os.close(fd)
    return path


def default_endpoints() -> tuple[str, str]:
    """The broker's frontend and backend endpoints when none is configured."""
    d = default_runtime_dir()
    return f"ipc://{d}/frontend.ipc", f"ipc://{d}/backend.ipc"


# A client's direct-reply socket (docs/protocol.md section 8): c-<pid>-<starttime>-<hex>.ipc
# in the runtime directory, and a worker's direct socket for leases (section 10):
# w-<pid>-<starttime>-<hex>.ipc, with its local link beside it (.link, broker/protocol/link.py);
# named like shared-memory segments so that a dead owner is told from a live one even after
# its pid is reused (the broker sweeps them all).
_REPLY_SOCKET_RE = re.compile(r"[cw]-(\d+)-(\d+)-[0-9a-f]+\.(?:ipc|link)")


def reply_socket_path() -> str:
    """A fresh path for this process's direct-reply socket."""
    pid, start = self_identity()
    return os.path.join(default_runtime_dir(), f"c-{pid}-{start}-{secrets.token_hex(6)}.ipc")


def direct_socket_path(runtime_dir: str | None = None) -> str:
    """A fresh path for this process's direct socket (a worker taking leases)."""
    pid, start = self_identity()
    d = runtime_dir if runtime_dir is not None else default_runtime_dir()
    return os.path.join(d, f"w-{pid}-{start}-{secrets.token_hex(6)}.ipc")


def parse_reply_socket_name(name: str) -> tuple[int, int] | None:
    """(pid, starttime) of the client that owns a reply-socket file name, or None if the name
    is not one."""
    m = _REPLY_SOCKET_RE.fullmatch(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def tcp_port_problem(endpoint: str) -> str | None:
    """Why a tcp:// endpoint's port is not one (libzmq takes 99999 and wraps it to 34463:
    found by the command-line hunt), or None (not tcp, or a port from 0 to 65535, or a
    service name libzmq resolves)."""
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return None
    port = endpoint.rsplit(":", 1)[1]
    if port.isdigit() and not 0 <= int(port) <= 65535:
        return f"{endpoint}: port {port} is not from 0 to 65535"
    return None


def endpoint_text_problem(endpoint: str) -> str | None:
    """Why libzmq cannot be given ``endpoint`` as text (None: it can).  libzmq takes UTF-8
    endpoints, and the interpreter turns the bytes of an argument or variable that are not
    UTF-8 (a directory named in Latin-1; any non-ASCII byte under a locale that is not
    UTF-8, PYTHONUTF8=0 LC_ALL=C) into lone surrogates that pyzmq cannot encode: the broker
    said only "'utf-8' codec can't encode character '\\udce9' in position 17", the worker
    ended in a traceback, and a client's connect raised UnicodeEncodeError (the
    streams hunt).  The endpoint is shown with those bytes escaped (``caf\\xe9``)."""
    try:
        endpoint.encode("utf-8")
    except UnicodeEncodeError:
        try:
            shown = os.fsencode(endpoint).decode("utf-8", "backslashreplace")
        except UnicodeError:
            shown = endpoint.encode("utf-8", "backslashreplace").decode("ascii")
        return (f"{shown}: the endpoint holds bytes that are not UTF-8 (a name made in another encoding, or a "
                f"locale that is not UTF-8), and ZeroMQ takes UTF-8 endpoints; rename the directory, or run under "
                f"a UTF-8 locale (LANG=C.UTF-8)")
    return None


def ipv6_for(sock, endpoint: str) -> None:
    """Turn on IPv6 (ZMQ_IPV6) on ``sock`` for a bracketed tcp address (``tcp://[::1]:5555``):
    libzmq leaves it off, and then fails such a bind ("No such device") and such a connect
    silently (found by the command-line hunt).  Other endpoints are left as they are."""
    if endpoint.startswith("tcp://["):
        import zmq

        sock.setsockopt(zmq.IPV6, 1)


def ipc_problem(endpoint: str, who: str = "this client") -> str | None:
    """Why an ipc `endpoint` cannot be connected to, as the kernel says it (None: nothing
    seen, or not ipc).  libzmq retries a failing ipc connect in silence, so a call to a
    broker that is not running, or runs as another user (its runtime directory is 0700),
    only ran out of time, and a worker whose broker came back on another backend endpoint
    only said the broker was silent; this names the cause.  Asked only once a call failed so,
    or a worker heard nothing (a stat and, where a socket file is there, one connect that is
    closed at once): never on the request path.  `who` names the asking process."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    if not path or path.startswith("@"):
        return None  # the abstract namespace: no file to look at
    me = os.getuid()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if any(pid_exists(pid) for pid in paused_by(path)):  # (moved aside by a broker still there)
            return (f"the broker at {path} takes no new clients now: it is near its descriptor limit (its log "
                    f"says so; raise its limit)")
        return f"no socket at {path} (no broker is bound there: not started, or bound elsewhere)"
    except PermissionError:
        return (f"permission denied on {path} (its directory is another user's, {who} runs as uid {me}: "
                f"run it as the broker's user)")
    except OSError as e:
        return f"cannot reach {path}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except PermissionError:
        return (f"permission denied on {path} (uid {st.st_uid}'s socket, {who} runs as uid {me}: run it as "
                f"the broker's user)")
    except ConnectionRefusedError:
        return f"nothing listens on {path} (the broker that bound it is gone and left the file)"
    except OSError:
        return None
    finally:
        probe.close()
    return None
