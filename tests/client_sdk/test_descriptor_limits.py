"""A client in a process near its descriptor limit (the SDK never changes its host's limits):
no reply socket is bound there, since the connection a worker makes to it would have libzmq
abort the whole process (its ipc listener asserts on EMFILE in accept); and running out of
descriptors is never reported as a runtime directory to remove."""
from __future__ import annotations

import errno
import os

import pytest
import zmq

from broker.protocol import naming
from client_sdk import sockets


def test_no_reply_socket_near_the_descriptor_limit(monkeypatch):
    ctx = zmq.Context.instance()
    monkeypatch.setattr(sockets, "nofile_limit", lambda: 1024)
    monkeypatch.setattr(sockets, "open_descriptors", lambda: 1000)  # 24 left: under the reserve
    assert sockets.ReplyInbox.open(ctx) is None
    monkeypatch.setattr(sockets, "open_descriptors", lambda: -1)  # cannot even list them
    assert sockets.ReplyInbox.open(ctx) is None
    monkeypatch.setattr(sockets, "open_descriptors", lambda: 40)
    inbox = sockets.ReplyInbox.open(ctx)
    assert inbox is not None
    inbox.close()


def test_out_of_descriptors_is_not_a_runtime_directory_to_remove(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    naming.default_runtime_dir()  # made
    real = os.open

    def starved(path, *a, **kw):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "open", starved)
    with pytest.raises(OSError) as info:
        naming.default_runtime_dir()
    assert not isinstance(info.value, naming.RuntimeDirError) and info.value.errno == errno.EMFILE


def test_a_pool_that_cannot_be_made_for_want_of_descriptors_is_tried_again(monkeypatch):
    # alloc() raised a raw shm.ShmError ("memfd_create failed"), and shared memory stayed
    # off for the client's life: every later tensor was copied inline.
    import numpy as np

    from client_sdk.core import ClientCore
    from client_sdk.errors import InferenceError

    real = os.memfd_create

    def starved(*a, **kw):
        raise OSError(errno.EMFILE, "Too many open files")

    core = ClientCore("ipc:///tmp/zinf-test-nobody.ipc")
    try:
        monkeypatch.setattr(os, "memfd_create", starved)
        with pytest.raises(InferenceError, match="out of descriptors or memory"):
            core.alloc((4,), np.float32)
        assert core.use_shm
        monkeypatch.setattr(os, "memfd_create", real)
        arr = core.alloc((4,), np.float32)  # descriptors back: shared memory again
        assert arr.shape == (4,) and core.pool is not None
        del arr
    finally:
        core.close()


def test_the_inbox_is_named_only_while_descriptors_allow_looked_at_once_a_second():
    """A server that fills its descriptors after making its client: the first worker to reply
    straight to it connected to its inbox, and libzmq aborted the process in that accept (the
    application hunt).  The core names the inbox (`reply_to`) only while `room()` said so,
    asked at the first request and then once a second (every five while half are free)."""
    import numpy as np

    from broker import protocol as P
    from client_sdk.core import ROOM_LOOK_FAR_S, ROOM_LOOK_S, ClientCore

    core = ClientCore("ipc:///nowhere", transport="inline")
    room = {"ok": (True, True), "asked": 0}

    def ask():
        room["asked"] += 1
        return room["ok"]

    core.use_inbox("ipc:///tmp/inbox", ask)
    x = {"x": np.zeros(2)}

    def reply_to(now):
        frames = core.request_frames(core.new_call("svc", x), now)
        return P.decode_request(frames[3]).reply_to

    room["ok"] = (False, False)  # filled after the client was made: the first request looks
    assert reply_to(100.0) is None and room["asked"] == 1
    room["ok"] = (True, True)
    assert reply_to(100.0 + ROOM_LOOK_S / 2) is None and room["asked"] == 1  # not asked again yet
    assert reply_to(100.0 + ROOM_LOOK_S) == "ipc:///tmp/inbox" and room["asked"] == 2
    # Plenty free: the next look is further off.
    assert reply_to(100.0 + 2 * ROOM_LOOK_S) == "ipc:///tmp/inbox" and room["asked"] == 2
    assert reply_to(100.0 + ROOM_LOOK_S + ROOM_LOOK_FAR_S) == "ipc:///tmp/inbox" and room["asked"] == 3
    core.close()


def test_descriptor_room_counts_them(monkeypatch):
    monkeypatch.setattr(sockets, "nofile_limit", lambda: 1024)
    monkeypatch.setattr(sockets, "open_descriptors", lambda: 1000)
    assert sockets.descriptor_room() == (False, False)
    monkeypatch.setattr(sockets, "open_descriptors", lambda: 700)
    assert sockets.descriptor_room() == (True, False)
    monkeypatch.setattr(sockets, "open_descriptors", lambda: 100)
    assert sockets.descriptor_room() == (True, True)
    monkeypatch.setattr(sockets, "open_descriptors", lambda: -1)
    assert sockets.descriptor_room() == (False, False)


@pytest.mark.parametrize("where", ["context", "socket"])
def test_a_client_made_without_descriptors_left_says_so(monkeypatch, where):
    """Out of descriptors, making a client raised libzmq's raw ZMQError (the application
    hunt): an InferenceError that names the cause, whether the context or the socket could
    not be made."""
    from client_sdk import Client, InferenceError

    def refuse(*a, **kw):
        raise zmq.ZMQError(errno.EMFILE)

    if where == "context":
        monkeypatch.setattr(zmq.Context, "instance", classmethod(refuse))
    else:
        monkeypatch.setattr(zmq.Context, "socket", refuse)
    # (with descriptors to spare, libzmq's EMFILE is its context's socket limit:
    # test_many_clients.py)
    monkeypatch.setattr(sockets, "descriptor_room", lambda: (False, False))
    with pytest.raises(InferenceError, match="out of descriptors"):
        Client("ipc:///nowhere/fe.ipc")


def test_a_pool_that_cannot_be_mapped_for_want_of_memory_is_tried_again(monkeypatch):
    # memfd_create succeeded, mmap failed (ENOMEM under RLIMIT_AS, or EMFILE for its
    # duplicate of the file): a plain ShmError, taken for the host's want of shared memory,
    # and the client sent every later tensor inline for its life.
    import mmap

    import numpy as np

    from client_sdk.core import ClientCore
    from client_sdk.errors import InferenceError
    from shm import segment

    real = mmap.mmap

    def starved(*a, **kw):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    core = ClientCore("ipc:///tmp/zinf-test-nobody.ipc")
    try:
        monkeypatch.setattr(segment.mmap, "mmap", starved)
        with pytest.raises(InferenceError, match="out of descriptors or memory"):
            core.alloc((4,), np.float32)
        assert core.use_shm
        monkeypatch.setattr(segment.mmap, "mmap", real)
        arr = core.alloc((4,), np.float32)  # memory back: shared memory again
        assert arr.shape == (4,) and core.pool is not None
        del arr
    finally:
        core.close()
