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
