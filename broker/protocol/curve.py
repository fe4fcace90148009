"""CurveZMQ keys as every tcp peer reads them: the server's public key, a peer's own key pair,
and the socket options a connecting peer sets.

A client and a worker each connect to the broker over tcp with CURVE (docs/security.md): they
need the broker's public key (to know they talk to the right server) and a key pair of their
own whose public half is in the broker's allow-list.  Keys are the certificate files that
`zmq.auth.create_certificates` writes (`python -m broker keys DIR --name NAME`): `NAME.key`
holds the public key, `NAME.key_secret` both halves.  The broker's side (allow-lists, ZAP,
making keys) is `broker.security`; this module is the part the client SDK and the worker share,
so it lives with the protocol that all three import.

Nothing here opens a socket but `configure_peer`, which only sets options on one.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

__all__ = [
    "CurveKeyError", "PeerKeys", "is_tcp", "z85_key", "load_public_key", "load_secret_cert", "peer_keys",
    "configure_peer", "ENV_SERVER_KEY",
]

log = logging.getLogger("broker.protocol")

#: the broker's public key (a certificate path or the 40-character z85 key) for clients and
#: workers that are not given one explicitly
ENV_SERVER_KEY = "ZMQ_INFER_SERVER_KEY"

_Z85_KEY_LEN = 40


class CurveKeyError(ValueError):
    """A key or certificate that is missing, unreadable or malformed, or a tcp endpoint with
    no keys and no explicit opt-out.  The message says what to pass."""


@dataclass(frozen=True)
class PeerKeys:
    """What a connecting peer needs (z85 bytes, 40 characters each)."""

    server: bytes   # the broker's public key
    public: bytes   # ours
    secret: bytes   # ours

    def __repr__(self) -> str:  # never print a secret key
        return f"PeerKeys(server={self.server.decode()!r}, public={self.public.decode()!r})"


def is_tcp(endpoint: Any) -> bool:
    """Whether a ZeroMQ endpoint is tcp (the transport CURVE protects)."""
    return isinstance(endpoint, str) and endpoint.startswith("tcp://")


def z85_key(value: Any) -> bytes | None:
    """`value` as a z85 key if it looks like one (40 characters that decode to 32 bytes)."""
    if isinstance(value, str):
        try:
            value = value.encode("ascii")
        except UnicodeEncodeError:
            return None
    if not isinstance(value, bytes) or len(value) != _Z85_KEY_LEN:
        return None
    try:
        if len(z85.decode(value)) == 32:
            return value
    except Exception:  # a character outside the alphabet, or a group beyond 32 bits
        pass
    return None


def load_public_key(value: Any, what: str = "server key") -> bytes:
    """A public key from a certificate file (`NAME.key`, or `NAME.key_secret`, whose public
    half is used) or from its 40-character z85 text."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and os.path.exists(value):
        public, secret = _read_cert(value, what)
        if secret is not None:
            # Taken (its public half is what is meant), but a secret certificate where a
            # public one will do is a secret copied where it need not be (the security audit).
            log.warning("the %s %s is a secret certificate: its public half is used; give this side the public "
                        "NAME.key instead and keep the secret with its owner alone", what, value)
        return public
    key = z85_key(value)
    if key is not None:
        return key
    raise CurveKeyError(
        f"{what} {value!r} is neither a certificate file that exists nor a 40-character z85 key "
        f"(the broker's public certificate is the NAME.key file that `python -m broker keys` wrote)")


def load_secret_cert(path: Any, what: str = "key") -> tuple[bytes, bytes]:
    """(public, secret) from a secret certificate file (`NAME.key_secret`)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise CurveKeyError(f"{what} must be the path of a secret certificate (NAME.key_secret), got {path!r}")
    public, secret = _read_cert(path, what)
    if secret is None:
        hint = f"; did you mean {path}_secret?" if path.endswith(".key") else ""
        raise CurveKeyError(f"{what} {path!r} holds no secret key (it is a public certificate){hint}")
    try:
        mode = os.stat(path).st_mode
    except OSError:  # pragma: no cover - it was just read
        mode = 0
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secret certificate %s is readable by other users (mode %o); chmod 600 it",
                    path, stat.S_IMODE(mode))
    return public, secret


#: the most of a certificate file read (one `zmq.auth.create_certificates` writes is a few
#: hundred bytes): a larger file is not a certificate, and is not read whole
MAX_CERT_BYTES = 64 << 10


def _read_cert(path: str, what: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of the certificate at ``path``, in the format
    `zmq.auth.create_certificates` writes.  Only a regular file (links followed) of at most
    `MAX_CERT_BYTES` is read, opened without waiting: a FIFO named ``x.key`` blocked the
    open for good, and a link to /dev/zero was read until memory ran out (the broker reads
    its allow-lists again while it runs, on a thread that such a read stopped)."""
    if not os.path.exists(path):
        # pyzmq says "Invalid certificate file" for a file that is not there: read as a
        # corrupt key, where a secret not mounted or a path misspelt was the cause (the
        # configuration hunt)
        raise CurveKeyError(f"cannot read the {what} certificate {path!r}: there is no such file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CurveKeyError(f"cannot read the {what} certificate {path!r}: it is not a regular file")
            if st.st_size > MAX_CERT_BYTES:
                raise CurveKeyError(f"cannot read the {what} certificate {path!r}: {st.st_size} bytes is too large "
                                    f"for a certificate (at most {MAX_CERT_BYTES})")
            # pyzmq's reader, on the file checked here (its descriptor's path: the same
            # file, whatever has been renamed over the name since)
            try:
                public, secret = zmq.auth.load_certificate(f"/proc/self/fd/{fd}")
            except ValueError:
                # (pyzmq's words name the descriptor's path, /proc/self/fd/N: what the file lacks
                # is said here instead, the file by its own name)
                empty = " (it is empty)" if not st.st_size else ""
                raise CurveKeyError(f"the {what} certificate {path!r} is not a certificate{empty}: it holds no "
                                    f"public-key line; expected a NAME.key (or NAME.key_secret) written by "
                                    f"`python -m broker keys DIR --name NAME`") from None
        finally:
            os.close(fd)
    except OSError as e:
        raise CurveKeyError(f"cannot read the {what} certificate {path!r}: {e}") from None
    if z85_key(public) is None or (secret is not None and z85_key(secret) is None):
        raise CurveKeyError(f"the {what} certificate {path!r} does not hold 40-character z85 keys")
    return public, secret


def peer_keys(endpoint: str, server_key: Any, own_key: Any, *, insecure: bool, server_opt: str,
              own_opt: str, insecure_opt: str, own_name: str, env_own: str | None = None) -> PeerKeys | None:
    """The keys a peer connecting to `endpoint` uses, or None for plain ZeroMQ.

    Not tcp: None (ipc is protected by the file system, docs/security.md).  tcp: both keys,
    from the arguments or else the environment (`ENV_SERVER_KEY`, `env_own`), unless
    `insecure`; with neither, `CurveKeyError` names the options to pass (`server_opt`,
    `own_opt`, `insecure_opt` are how the caller spells them, e.g. ``--server-key``)."""
    if not is_tcp(endpoint):
        return None
    if insecure:
        if server_key is not None or own_key is not None:
            raise CurveKeyError(f"{insecure_opt} asks for plain tcp, yet keys were given ({server_opt}, "
                                f"{own_opt}); pass one or the other")
        return None
    # Where a key came from, for its error: one read from the environment was named as if
    # it had been passed ("server key 'garbage' is neither ..."), and an operator who passed
    # nothing could not tell where it came from (the configuration hunt).
    server_from = own_from = ""
    if server_key is None:
        server_key = os.environ.get(ENV_SERVER_KEY) or None
        server_from = f" (from ${ENV_SERVER_KEY}; {server_opt} overrides it)" if server_key is not None else ""
    if own_key is None and env_own is not None:
        own_key = os.environ.get(env_own) or None
        own_from = f" (from ${env_own}; {own_opt} overrides it)" if own_key is not None else ""
    if server_key is None or own_key is None:
        missing = [opt for opt, v in ((server_opt, server_key), (own_opt, own_key)) if v is None]
        raise CurveKeyError(
            f"{endpoint} is a tcp endpoint, which needs CurveZMQ keys: pass {' and '.join(missing)} "
            f"({server_opt}: the broker's public certificate, e.g. keys/server.key; {own_opt}: this "
            f"{own_name}'s secret certificate, made by `python -m broker keys DIR --name {own_name}`, whose "
            f"public half is in the broker's allow-list), or {insecure_opt} for plain, unauthenticated tcp")
    try:
        server = load_public_key(server_key, "server key")
    except CurveKeyError as e:
        raise CurveKeyError(f"{e}{server_from}") from None
    try:
        public, secret = load_secret_cert(own_key, f"{own_name} key")
    except CurveKeyError as e:
        raise CurveKeyError(f"{e}{own_from}") from None
    return PeerKeys(server=server, public=public, secret=secret)


def configure_peer(sock: zmq.Socket, keys: PeerKeys | None) -> None:
    """Set a connecting socket's CURVE options (before `connect`); nothing for None."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
