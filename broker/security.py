"""CurveZMQ on the broker's tcp endpoints: keys, allow-lists, ZAP and server sockets.

A tcp endpoint is reachable by any process that can reach the address, so the broker
authenticates and encrypts every tcp connection with CURVE (docs/security.md):

- the broker holds a server key pair (`--curve-secret server.key_secret`);
- clients and workers each hold a key pair of their own; the broker accepts a connection on
  the frontend only from a public key in the client allow-list (`--client-keys DIR`, a
  directory of `*.key` public certificates, as `zmq.auth` reads them) and on the backend only
  from one in the worker allow-list (`--worker-keys DIR`).  The two lists are told apart by
  the ZAP domain of the socket: a client key cannot register as a worker;
- plain tcp only with an explicit `insecure`, which logs a warning naming the endpoint.

ipc endpoints are untouched: they live in the 0700 runtime directory and their socket files
are 0600 (`broker.protocol.naming`), so the kernel keeps other users out.

The ZAP handler is pyzmq's `zmq.auth.thread.ThreadAuthenticator`: a thread that libzmq asks
once per tcp handshake and that sleeps otherwise, so the broker's single-threaded loop and
its ipc hot path do not see it.  Everything here but `ServerCurve.start` and
`configure_server` is socket-free.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.auth

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

from broker import protocol as P
from broker.protocol import curve as C
from broker.protocol.wire import dup_socket

__all__ = [
    "SecurityError", "SecurityConfig", "FRONTEND_DOMAIN", "BACKEND_DOMAIN", "make_keys",
    "load_allow_list", "load_allow_entries", "read_allow_list", "load_server_secret", "plan", "CurvePlan", "configure_server", "ServerCurve",
    "TCP_REFS", "peer_is_tcp", "kernel_guarded", "names_local_memory", "allow_list_state", "RELOAD_PERIOD_S", "LOOK_SHARE",
]

log = logging.getLogger("broker")
#: keys refused by the allow-lists (the ZAP thread's), one log per ZAP domain: a flood of
#: unknown client keys must not hide a refused worker's among the suppressed
_refusals: dict[str, P.RateLimitedLog] = collections.defaultdict(lambda: P.RateLimitedLog(log, 10.0))

#: how often the allow-list directories are looked at for added and removed keys (seconds)
RELOAD_PERIOD_S = 1.0
#: a look that takes long (a huge directory, a slow file system) is followed by a wait this
#: many times as long: the watcher takes at most about 1/LOOK_SHARE of a core
LOOK_SHARE = 20

#: ZAP domains of the two sockets: which allow-list a handshake is checked against
FRONTEND_DOMAIN = "zmq-infer.clients"
BACKEND_DOMAIN = "zmq-infer.workers"

SECURITY_OPTIONS = ("curve_secret", "client_keys", "worker_keys", "insecure")


class SecurityError(ValueError):
    """Security settings that cannot serve the configured endpoints (a tcp endpoint without
    keys, an allow-list that is missing or empty, a key file that cannot be read).  The message
    says what to pass."""


@dataclass
class SecurityConfig:
    """The broker's CURVE settings (`[broker.security]` in the TOML file; the CLI flags of the
    same names override them)."""

    curve_secret: str = ""   # the server's secret certificate (NAME.key_secret)
    client_keys: str = ""    # directory of clients' public certificates (*.key)
    worker_keys: str = ""    # directory of workers' public certificates (*.key)
    insecure: bool = False   # plain tcp (logs a warning); never with keys

    @classmethod
    def from_table(cls, table: Any, source: str, base_dir: str = "") -> "SecurityConfig":
        """From a TOML table; relative paths are taken from `base_dir` (the file's directory)."""
        if not isinstance(table, dict):
            raise SecurityError(f"{source}: [security] must be a table")
        cfg = cls()
        for key, value in table.items():
            if key not in SECURITY_OPTIONS:
                raise SecurityError(f"{source}: unknown security option {key!r} (known: {', '.join(SECURITY_OPTIONS)})")
            if key == "insecure":
                if not isinstance(value, bool):
                    raise SecurityError(f"{source}: security.insecure must be true or false, got {value!r}")
            else:
                if not isinstance(value, str):
                    raise SecurityError(f"{source}: security.{key} must be a path (a string), got {value!r}")
                if value and base_dir:
                    value = os.path.join(base_dir, os.path.expanduser(value))
            setattr(cfg, key, value)
        return cfg


# ------------------------------------------------------------------------------------ keys

def make_keys(directory: str, name: str, *, overwrite: bool = False) -> tuple[str, str]:
    """Write a key pair `DIR/NAME.key` (public, 0644) and `DIR/NAME.key_secret` (0600) with
    `zmq.auth.create_certificates`; returns their paths.  The directory is created 0700 if
    missing; existing files are kept unless `overwrite`."""
    if not name or os.sep in name or name.startswith("."):
        raise SecurityError(f"key name {name!r} must be a plain file name such as 'server', 'client' or 'worker'")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = (os.path.join(directory, name + ext) for ext in (".key", ".key_secret"))
    if not overwrite:
        there = [p for p in (public, secret) if os.path.lexists(p)]
        if there:
            raise SecurityError(f"{' and '.join(there)} already exist; pick another name, or overwrite them on purpose (--force)")
    # The secret file is created 0600 (not created world-readable and then narrowed): the
    # helper opens files with the process umask, so narrow that for the call.
    old = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def load_server_secret(path: str) -> tuple[bytes, bytes]:
    """The server's (public, secret) key pair from its secret certificate."""
    try:
        return C.load_secret_cert(path, "server (--curve-secret, [security] curve_secret)")
    except C.CurveKeyError as e:
        raise SecurityError(str(e)) from None


def _certificates(entries):
    """The entries of an allow-list directory that are read as public certificates: ``*.key``,
    not hidden (the start's read and the reload's watch take the same ones)."""
    return [e for e in entries if e.name.endswith(".key") and not e.name.startswith(".")]


def read_allow_list(directory: str, what: str) -> tuple[dict[str, bytes], dict[str, str]]:
    """Each ``*.key`` entry of an allow-list directory read on its own: (name -> key of the
    entries that read, name -> why of those that do not).  A directory that is missing or
    cannot be listed is an error."""
    if not directory or not os.path.isdir(directory):
        raise SecurityError(f"{what} allow-list {directory!r} is not a directory of public certificates (*.key)")
    try:
        # Listed here, not by glob, which takes a directory it may not list for an empty
        # one: permissions taken away read as "holds no public certificate".
        with os.scandir(directory) as it:
            names = sorted(e.name for e in _certificates(it))
    except OSError as e:
        raise SecurityError(f"cannot list the {what} allow-list {directory!r}: {e.strerror or e}") from None
    good: dict[str, bytes] = {}
    bad: dict[str, str] = {}
    for name in names:
        try:
            good[name] = C.load_public_key(os.path.join(directory, name), f"{what} allow-list")
        except C.CurveKeyError as e:
            bad[name] = str(e)
    return good, bad


def load_allow_entries(directory: str, what: str) -> dict[str, bytes]:
    """name -> z85 public key of the `*.key` certificates in `directory`; one that does not
    read, or an allow-list that is missing or empty, is an error (an empty one would refuse
    everyone, which is never what was meant)."""
    good, bad = read_allow_list(directory, what)
    if bad:
        raise SecurityError(next(iter(bad.values())))
    if not good:
        raise SecurityError(f"{what} allow-list {directory!r} holds no public certificate (*.key); copy the "
                            f"NAME.key file of each {what} allowed in there")
    return good


def load_allow_list(directory: str, what: str) -> frozenset[bytes]:
    """The z85 public keys of the `*.key` certificates in `directory` (`load_allow_entries`)."""
    return frozenset(load_allow_entries(directory, what).values())


def _warn_if_writable(directory: str, who: str) -> None:
    """A WARNING for an allow-list directory that another user may write to: whoever can
    copy a key in there is let in within a second (the broker reads it again while it runs;
    the security audit)."""
    try:
        st = os.stat(directory)
    except OSError:
        return
    euid = os.geteuid()
    other = st.st_uid not in (euid, 0)
    if other or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("the %s allow-list %s is %s: whoever can write a key there is let in; make it the "
                    "broker's user's, mode 0755 or less", who, directory,
                    f"owned by uid {st.st_uid}" if other else f"writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def allow_list_state(directory: str) -> tuple:
    """What a reload watches of an allow-list directory: each ``*.key`` entry's name and,
    links followed, its inode, size, modification and change times, sorted; a directory that cannot
    be listed is its error.  Two equal states hold the same keys: a copy, a removal, a
    rename, an editor's rewrite and a Kubernetes Secret volume's swap of ``..data`` (a new
    inode behind the same name) each change it."""
    try:
        with os.scandir(directory) as it:
            entries = _certificates(it)
    except OSError as e:
        return (("error", e.errno),)
    state = []
    for e in entries:
        try:
            st = e.stat()  # follows links, as the reload's open does
        except OSError as err:
            state.append((e.name, "error", err.errno))
        else:
            state.append((e.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    state.sort()
    return tuple(state)


# ------------------------------------------------------------------------------------ the plan

@dataclass(frozen=True)
class CurvePlan:
    """Which of the broker's sockets use CURVE, and with what.  `insecure` lists the tcp
    endpoints served in plain text (the warning names them)."""

    public: bytes | None = None
    secret: bytes | None = None
    allow: tuple[tuple[str, str, frozenset], ...] = ()   # (role, domain, keys) for each CURVE socket
    insecure: tuple[str, ...] = ()
    #: (role, directory, its `allow_list_state` read just before the keys, entry name -> key)
    #: of each list
    sources: tuple[tuple[str, str, tuple, dict], ...] = ()

    def domain_of(self, role: str) -> str | None:
        for r, domain, _ in self.allow:
            if r == role:
                return domain
        return None

    @property
    def enabled(self) -> bool:
        return bool(self.allow)


_FIX = ("pass --curve-secret FILE (the broker's NAME.key_secret) with --client-keys DIR and/or "
        "--worker-keys DIR (directories of allowed public *.key certificates) for the tcp endpoints; "
        "`python -m broker keys DIR --name NAME` makes key pairs; or --insecure for plain, "
        "unauthenticated tcp (the [broker.security] table of the TOML file takes the same keys)")


def kernel_guarded(ep: str) -> bool:
    """ipc:// socket files (file permissions) and inproc:// (one process) need no keys."""
    return (ep.startswith("ipc://") and not ep.startswith("ipc://@")) or ep.startswith("inproc://")


def plan(cfg: SecurityConfig, frontend: str, backend: str) -> CurvePlan:
    """Check the settings against the endpoints (before anything binds) and load the keys.

    tcp endpoints need the server key and the allow-list of their side, unless `insecure`;
    anything else (ipc, inproc) takes no keys."""
    sides = [("frontend", frontend, cfg.client_keys, "--client-keys", "client", FRONTEND_DOMAIN),
             ("backend", backend, cfg.worker_keys, "--worker-keys", "worker", BACKEND_DOMAIN)]
    tcp = [s for s in sides if C.is_tcp(s[1])]
    keys_given = bool(cfg.curve_secret or cfg.client_keys or cfg.worker_keys)
    bare = [ep for _, ep, *_ in sides if ep and not C.is_tcp(ep) and not kernel_guarded(ep)]
    if bare and not cfg.insecure:
        raise SecurityError(f"refusing to serve {' and '.join(bare)}: only tcp (with CurveZMQ), ipc:// socket "
                            f"files (guarded by their directory's and their own permissions) and inproc:// are "
                            f"protected; an abstract ipc://@name or another transport lets any local user or "
                            f"network peer in.  Use one of those, or pass --insecure")
    if cfg.insecure:
        if keys_given:
            raise SecurityError("--insecure (security.insecure) asks for plain tcp, yet CURVE keys were given "
                                "(--curve-secret, --client-keys, --worker-keys); pass one or the other")
        return CurvePlan(insecure=tuple(ep for _, ep, *_ in sides if ep and not kernel_guarded(ep)))
    # Keys for an endpoint that is not tcp are not needed, and were ignored without a word:
    # an operator who meant tcp learns it here (the command-line hunt).
    unused = [flag for _, ep, directory, flag, *_ in sides if directory and not C.is_tcp(ep)]
    if cfg.curve_secret and not tcp:
        unused.insert(0, "--curve-secret")
    if unused:
        log.warning("%s given, but %s: CurveZMQ guards tcp endpoints only (ipc:// is guarded by file "
                    "permissions); not used", ", ".join(unused),
                    " and ".join(f"the {role} {ep} is not tcp" for role, ep, directory, *_ in sides
                                 if not C.is_tcp(ep) and (directory or not tcp)))
    if not tcp:
        return CurvePlan()
    if not cfg.curve_secret:
        eps = " and ".join(f"{role} {ep}" for role, ep, *_ in tcp)
        raise SecurityError(f"refusing to serve {eps} without CurveZMQ: anyone who can reach a tcp endpoint "
                            f"could act as a client or a worker; {_FIX}")
    public, secret = load_server_secret(cfg.curve_secret)
    allow, sources = [], []
    for role, ep, directory, flag, who, domain in tcp:
        if not directory:
            raise SecurityError(f"the {role} {ep} is tcp, so it needs the allow-list of {who} keys: pass {flag} DIR "
                                f"(a directory of the allowed {who}s' public *.key certificates)")
        # The directory's state before its keys, as a reload reads them: a change in between
        # is seen at the watcher's first look (read after, at its start, it was never seen).
        state = allow_list_state(directory)
        entries = load_allow_entries(directory, who)
        _warn_if_writable(directory, who)
        allow.append((role, domain, frozenset(entries.values())))
        sources.append((role, directory, state, entries))
    return CurvePlan(public=public, secret=secret, allow=tuple(allow), sources=tuple(sources))


# ------------------------------------------------------------------------------------ sockets

def configure_server(sock: zmq.Socket, secret: bytes, domain: str) -> None:
    """Make a socket a CURVE server (before `bind`); ZAP checks each peer in `domain`."""
    sock.curve_server = True
    sock.curve_secretkey = secret
    sock.zap_domain = domain.encode()


configure_client = C.configure_peer  # the connecting side (clients, workers, tests)


_WHO = {"frontend": "client", "backend": "worker"}


class _AllowList:
    """A `zmq.auth` credentials provider: the public keys one ZAP domain accepts.  ``keys``
    is replaced whole by a reload (the ZAP thread reads one set or the other, never half)."""

    def __init__(self, keys: frozenset[bytes], role: str = "", directory: str = "", state: tuple | None = None,
                 entries: dict[str, bytes] | None = None):
        self.keys = keys
        self.role = role
        self.directory = directory
        #: the directory's state when ``keys`` were read (read before them)
        self.state = state if state is not None else allow_list_state(directory) if directory else ()
        #: entry name -> the key it held when last read whole or still held (what a list
        #: that fails its checks is compared with: its removals are applied)
        self.entries: dict[str, bytes] = dict(entries) if entries is not None else {}
        self.failed: tuple | None = None  # the state a reload refused (said once)

    def reload(self) -> tuple[frozenset, frozenset] | None:
        """Read the directory again if it changed: (added, removed) when a new list was
        taken, None when nothing changed.  The list taken is the keys of the entries that
        read; an entry that does not (a half-copied file, a stray README.key, a FIFO: an
        ERROR, once per state of the directory) adds nothing, and keeps the key it held, if
        it held one (an editor's half-written rewrite is not a removal).  So a removal holds
        beside a stray entry (it stayed in force for as long as one sat there: the security
        audit), and so does a rotation (a new key copied in, the old one removed).  A
        directory emptied, missing or unlisted, or with no entry that reads, keeps the
        previous list whole: that reads as a mistake (docs/deploy.md)."""
        state = allow_list_state(self.directory)
        if state == self.state or state == self.failed:
            return None
        who = _WHO.get(self.role, self.role)
        try:
            good, bad = read_allow_list(self.directory, who)
        except SecurityError as e:
            good, bad = {}, {"": str(e)}
        if not good:
            self.failed = state
            why = next(iter(bad.values())) if bad else (f"{who} allow-list {self.directory!r} holds no public "
                                                        "certificate (*.key)")
            log.error("the %s allow-list changed but cannot be taken (%s); the previous one, %d key(s), stays in "
                      "force", who, why, len(self.keys))
            return None
        # The state read before the keys: a change between the two is seen at the next look.
        kept = {name: key for name, key in self.entries.items() if name in bad}
        entries = {**kept, **good}
        keys = frozenset(entries.values())
        self.state, self.failed = state, None
        added, removed = keys - self.keys, self.keys - keys
        self.keys, self.entries = keys, entries
        if bad:
            log.error("the %s allow-list %s changed, but %d of its entries cannot be taken (%s): each adds nothing "
                      "until it reads, and keeps the key it held; %d key(s) in force", who, self.directory, len(bad),
                      next(iter(bad.values())), len(keys))
            if not added and not removed:
                return None
        # A WARNING, as the refusals are: who may connect changed, a line worth having in a
        # log kept at the default level (INFO is a line per request).
        log.warning("%s allow-list %s reloaded: %d key(s), %d added, %d removed", who, self.directory, len(keys),
                    len(added), len(removed))
        return added, removed

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        # WARNING (rate-limited): a worker or client refused here hears nothing but silence,
        # so this line is the operator's one clue.
        _refusals[domain].warning("refused a tcp peer: CURVE key %s is not in the %s allow-list",
                          key.decode(errors="replace"), domain)
        return False


class ServerCurve:
    """The ZAP handler of one broker: `start()` before binding the CURVE sockets, `stop()`
    after closing them.  One per zmq.Context (ZAP has one address per context)."""

    def __init__(self, ctx: zmq.Context, plan: CurvePlan, reload_period: float = RELOAD_PERIOD_S):
        self.plan = plan
        self.ctx = ctx
        self.auth: ThreadAuthenticator | None = None
        self.lists: dict[str, _AllowList] = {}   # role -> its allow-list
        #: (role, removed keys) of each reload that removed some, for the broker's loop to
        #: act on (`Broker._apply_revocations`); appended by the watcher thread
        self.removals: collections.deque = collections.deque()
        #: whether any key was ever removed: until then every connection's key is on its list
        #: (the handshake checked it), so the loop need not look
        self.revoked = False
        self._reload_period = reload_period
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        if not self.plan.enabled:
            return
        # Imported here, only where keys are in use: it imports asyncio (through zmq.asyncio),
        # which took 25-50 ms of every broker's start, an ipc broker's too.
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("broker.zap"))
        try:
            auth.start()
        except zmq.ZMQError as e:
            auth.stop()
            raise SecurityError(f"cannot start the ZAP handler ({e}): another CURVE broker uses this "
                                f"zmq.Context; give each broker a context of its own") from None
        dirs = {role: (directory, state, entries) for role, directory, state, entries in self.plan.sources}
        for role, domain, keys in self.plan.allow:
            # Keys loaded and checked here (configure_curve only logs a directory it cannot
            # read); a domain with no list is refused by the authenticator.
            directory, state, entries = dirs.get(role, ("", None, None))
            lst = self.lists[role] = _AllowList(keys, role, directory, state, entries)
            auth.configure_curve_callback(domain, lst)
        self.auth = auth
        if any(lst.directory for lst in self.lists.values()) and self._reload_period > 0:
            self._watcher = threading.Thread(target=self._watch, name="allow-lists", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        wait = self._reload_period
        while not self._stop.wait(wait):
            began = time.monotonic()
            try:
                self.reload()
            except Exception:  # a look that failed is tried again at the next; never the thread's end
                log.exception("looking at the allow-lists failed")
            # A look is a stat of each entry, partly under the GIL the broker's loop needs: a
            # directory of 100,000 keys took 0.6 s, which once a second was more than half a
            # core for good.  One that takes long waits `LOOK_SHARE` times as long for the next.
            wait = max(self._reload_period, LOOK_SHARE * (time.monotonic() - began))

    def reload(self) -> None:
        """Look at each allow-list directory now (the watcher does, every `RELOAD_PERIOD_S`)."""
        for role, lst in self.lists.items():
            if not lst.directory:
                continue
            change = lst.reload()
            if change is not None and change[1]:
                self.revoked = True
                self.removals.append((role, change[1]))

    def allowed(self, role: str, user_id: str | bytes) -> bool:
        """Whether a connection's key (its ZAP User-Id, the z85 key) is on ``role``'s list
        now; True for a role without one."""
        lst = self.lists.get(role)
        if lst is None:
            return True
        key = user_id.encode() if isinstance(user_id, str) else bytes(user_id)
        return key in lst.keys

    def configure(self, sock: zmq.Socket, role: str) -> None:
        domain = self.plan.domain_of(role)
        if domain is not None:
            configure_server(sock, self.plan.secret, domain)

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
            self._watcher = None
        if self.auth is not None:
            self.auth.stop()
            self.auth = None


# ------------------------------------------------------------------------------------ tcp requests

#: the FINAL error (400) of a tcp peer's request that names memory or a socket of this host
TCP_REFS = "tcp peers may not send shared-memory or CUDA references or reply_to; send tensors inline"


def peer_is_tcp(frame: Any, unknown: bool = False) -> bool:
    """Whether a received frame came over a tcp connection (the family of its SRCFD);
    ``unknown`` when that cannot be told (not a received frame, inproc, or no descriptor to
    look with: a broker out of descriptors, where a tcp frontend must answer True, or its
    refusal of shared-memory references over tcp fails open: found by the CURVE hunt)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError):
        return unknown
    s = dup_socket(fd)
    if s is None:  # closed, or not a socket (a file's by now: no copy left open)
        return unknown
    try:
        return s.family in (socket.AF_INET, socket.AF_INET6)
    finally:
        s.close()


def names_local_memory(req: Any) -> bool:
    """Whether a request header names anything of this host's: a shared-memory or CUDA tensor,
    or a reply socket (what a tcp peer may not send: its owner is nobody the broker knows)."""
    if req.reply_to is not None:
        return True
    inline = P.InlineLoc
    return any(type(t.loc) is not inline for t in req.tensors)
