"""The SDK's public surface, pinned: the two client twins mirror each other, `__all__` lists
exactly what is public, every error class lives in errors.py, the core is socket-free, and
streams use only the clients' public seams.  Read from the classes and the source, no socket."""
from __future__ import annotations

import ast
import inspect
import pathlib
import pkgutil
import re

import numpy as np
import pytest

import client_sdk
from broker import protocol as P
from client_sdk import AsyncClient, AsyncReplyStream, Client, ReplyStream, errors

SDK = pathlib.Path(client_sdk.__file__).parent

#: methods that wait: coroutines on AsyncClient, blocking on Client; every other method of
#: either twin returns at once on both
WAITS = {"infer", "request", "mmi_service", "close", "pump"}
#: the asyncio idiom's alias of close(), for contextlib.aclosing; the one name only one twin has
ASYNC_ONLY = {"aclose"}


def _public(cls: type) -> dict[str, object]:
    return {n: inspect.getattr_static(cls, n) for n in dir(cls) if not n.startswith("_")}


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()]


def test_client_twins_have_the_same_public_surface():
    sync, aio = _public(Client), _public(AsyncClient)
    assert set(aio) - set(sync) == ASYNC_ONLY
    assert set(sync) - set(aio) == set()
    assert WAITS <= set(sync)
    for name, s in sync.items():
        a = aio[name]
        assert isinstance(s, property) == isinstance(a, property), name
        if isinstance(s, property):
            continue
        assert callable(s) and callable(a), name
        assert _params(s) == _params(a), f"{name}: {inspect.signature(s)} != {inspect.signature(a)}"
        assert not inspect.iscoroutinefunction(s), name
        assert inspect.iscoroutinefunction(a) == (name in WAITS), name
    assert _params(Client.__init__) == _params(AsyncClient.__init__)
    # Context managers of their kind.
    assert hasattr(Client, "__enter__") and hasattr(Client, "__exit__")
    assert hasattr(AsyncClient, "__aenter__") and hasattr(AsyncClient, "__aexit__")
    assert AsyncClient.aclose is AsyncClient.close


def test_reply_stream_twins_have_the_same_public_surface():
    sync, aio = _public(ReplyStream), _public(AsyncReplyStream)
    assert set(aio) - set(sync) == ASYNC_ONLY
    assert set(sync) <= set(aio)
    assert hasattr(ReplyStream, "__next__") and hasattr(AsyncReplyStream, "__anext__")


def test_package_all_is_pinned():
    assert client_sdk.__all__ == [
        "Client", "AsyncClient", "Result", "ReplyStream", "AsyncReplyStream", "Stream", "AsyncStream",
        "StreamStats", "EndOfStream", "run", "errors", "InferenceError", "ServiceUnavailable",
        "DeadlineExceeded", "QueueFull", "Cancelled", "ProtocolError", "WorkerFailed", "NotLocal", "Forbidden",
        "BrokerUnreachable", "InternalError", "NotSupported", "InvalidInput", "PoolFull", "Priority",
    ]
    assert client_sdk.Priority is P.Priority  # the protocol's: `infer(priority=Priority.URGENT)`
    for name in client_sdk.__all__:
        assert getattr(client_sdk, name) is not None, name
    public = {n for n in vars(client_sdk) if not n.startswith("_")}
    submodules = {m.name for m in pkgutil.iter_modules([str(SDK)])}
    assert public - set(client_sdk.__all__) <= submodules  # nothing else leaks out


def test_errors_public_names_are_pinned():
    assert errors.__all__ == [
        "InferenceError", "ServiceUnavailable", "DeadlineExceeded", "QueueFull", "Cancelled",
        "ProtocolError", "WorkerFailed", "NotLocal", "Forbidden", "BrokerUnreachable", "InternalError",
        "NotSupported", "InvalidInput", "EndOfStream", "PoolFull", "error_from",
    ]
    classes = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)
               and v.__module__ == errors.__name__}
    assert classes == set(errors.__all__) - {"error_from"}
    # Every class the package exports is errors' own.
    for name in client_sdk.__all__:
        v = getattr(client_sdk, name)
        if isinstance(v, type) and issubclass(v, BaseException):
            assert v is getattr(errors, name), name


def test_moved_errors_keep_their_bases_and_old_import_paths():
    from client_sdk import stream, tensors

    assert issubclass(errors.InvalidInput, errors.InferenceError) and issubclass(errors.InvalidInput, ValueError)
    assert issubclass(errors.EndOfStream, errors.InferenceError) and issubclass(errors.EndOfStream, LookupError)
    assert errors.InvalidInput.code is None and errors.EndOfStream.code is None
    import shm

    assert issubclass(errors.PoolFull, errors.InferenceError) and issubclass(errors.PoolFull, shm.ShmFull)
    assert tensors.InvalidInput is errors.InvalidInput is client_sdk.InvalidInput
    assert stream.EndOfStream is errors.EndOfStream is client_sdk.EndOfStream


def test_exception_tree_comment_names_every_class_with_its_bases():
    src = (SDK / "errors.py").read_text()
    tree = "\n".join(line for line in src.splitlines() if line.startswith("#"))
    for name in set(errors.__all__) - {"error_from"}:
        cls = getattr(errors, name)
        line = next((ln for ln in tree.splitlines() if re.search(rf"[─ ]{name}\b", ln)), None)
        assert line is not None, f"{name} is missing from the tree at the top of errors.py"
        for base in cls.__bases__[1:]:  # the builtin a class also is must be written next to it
            assert base.__name__ in line, (name, base.__name__)


def test_every_exception_class_is_defined_in_errors():
    """No module of the SDK defines an exception class of its own (private ones included)."""
    for path in sorted(SDK.glob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                assert not {"Exception", "BaseException", "InferenceError", "LookupError", "ValueError",
                            "TimeoutError"} & bases, f"{path.name}: class {node.name}"


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("name", ["core.py", "calls.py", "pins.py"])
def test_core_is_socket_free(name):
    """No socket, no event loop, no clock: time is passed in."""
    assert not {"zmq", "asyncio", "time", "socket", "selectors"} & _imports(SDK / name)


@pytest.mark.parametrize("name", ["stream.py", "base.py"])
def test_streams_touch_only_public_client_seams(name):
    """Nothing but `self` has an underscored attribute read in these modules."""
    for node in ast.walk(ast.parse((SDK / name).read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            assert isinstance(node.value, ast.Name) and node.value.id == "self", \
                f"{name}:{node.lineno}: .{node.attr} of something other than self"


def test_no_underscored_name_crosses_a_module_of_the_sdk():
    """`from x import _y` and `module._y` are forbidden (private helpers get public names)."""
    for path in sorted(SDK.glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    assert not a.name.startswith("_"), f"{path.name}: from {node.module} import {a.name}"
                    if node.level and node.module is None:  # from . import tensors as T
                        modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name.split(".")[0] for a in node.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                pytest.fail(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")


def test_an_error_that_never_crossed_the_wire_has_no_code(tmp_path):
    """docs/client.md: `.code` is the wire ErrorCode, or None.  The base class said 500, so
    "this client is closed" and the SDK's other local errors read INTERNAL."""
    assert errors.InferenceError("local").code is None
    assert errors.InternalError().code == 500
    assert errors.error_from(599, "new").code == 599 and type(errors.error_from(599)) is errors.InferenceError
    c = client_sdk.Client(f"ipc://{tmp_path}/nobody.ipc", timeout=1)
    c.close()
    with pytest.raises(errors.InferenceError, match="closed") as ei:
        c.infer("echo", {"x": np.zeros(2)})
    assert type(ei.value) is errors.InferenceError and ei.value.code is None


def test_a_plain_request_of_more_frames_than_the_broker_takes_is_refused_before_sending(tmp_path):
    """The broker drops a message of more than wire.MAX_FRAMES frames unread, and its
    connection: the call waited for its deadline.  `request()` refuses it first."""
    from broker.protocol.wire import MAX_FRAMES
    from client_sdk.core import MAX_BODY_FRAMES

    assert MAX_BODY_FRAMES == MAX_FRAMES - 4
    with client_sdk.Client(f"ipc://{tmp_path}/nobody.ipc", timeout=1) as c:
        with pytest.raises(errors.InvalidInput, match=f"at most {MAX_BODY_FRAMES}"):
            c.request("svc", [b""] * (MAX_BODY_FRAMES + 1))


def test_a_service_unavailable_error_adds_its_advice_only_where_the_broker_gave_none():
    """The client's advice ("start a worker ...") follows a message that has none; the
    broker's drain ("send the request elsewhere or later") and its full queue with no
    worker ("start a worker ...") say what to do already: it was added to both (the
    operations audit: a stopping broker's callers were told to start a worker)."""
    from broker.launcher import _DRAIN_REASON

    plain = errors.ServiceUnavailable("no worker serves 'x'")
    assert str(plain).count("start a worker") == 1
    drain = errors.ServiceUnavailable(_DRAIN_REASON)
    assert str(drain) == _DRAIN_REASON
    full = ("no live worker for 'x': its last one went 2.0 s ago, and the queue is full (0 waiting): nothing "
            "can wait for one; start a worker for the service, or check its name")
    assert str(errors.ServiceUnavailable(full)) == full
    lost = errors.ServiceUnavailable("no live worker for 'x': its last one went 2.0 s ago")
    assert "look at its workers" in str(lost) and "start a worker" not in str(lost)
