"""Data fidelity end to end: whatever a client sends comes back from an echo worker exactly
(dtype, shape, every byte), or is refused with a typed error, on every path a tensor takes:
inline frames, shared memory (small tensors inline, larger in temporary slots or by
reference from `client.alloc`), and a pinned client's lease on the worker's local link; a
batching worker stacks only compatible requests and gives every client its own rows; a
model's outputs in any layout (Fortran order, reversed, strided, broadcast, 0-d, views of
the input) arrive as the model computed them.  Real broker and worker processes, ipc only."""
from __future__ import annotations

import asyncio
import warnings
from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from broker import protocol as P
from client_sdk import AsyncClient, Client, InvalidInput

from .conftest import wait_service
from .layouts_model import expected as layouts_expected

pytestmark = pytest.mark.timeout(120)

SMALL = P.SMALL_INLINE_BYTES

# Every dtype with bytes to send, in both byte orders where it has one.
_DTYPES = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="?"),
    hnp.unsigned_integer_dtypes(endianness="?"),
    hnp.floating_dtypes(endianness="?", sizes=(16, 32, 64)),
    hnp.complex_number_dtypes(endianness="?"),
    hnp.datetime64_dtypes(endianness="?"),
    hnp.timedelta64_dtypes(endianness="?"),
    hnp.byte_string_dtypes(min_len=1, max_len=5),
    hnp.unicode_string_dtypes(endianness="?", min_len=1, max_len=3),
    st.sampled_from([np.dtype("V3"), np.dtype([("a", "<i2"), ("b", ">f8"), ("c", "S3")]),
                     np.dtype(np.longdouble), np.dtype(np.clongdouble)]),
)

_LAYOUTS = ("c", "fortran", "reversed", "strided", "broadcast", "transposed", "unaligned")


@st.composite
def _arrays(draw):
    """An array of any dtype, of a random shape or of a size around the inline crossover,
    with random bytes (NaN payloads, NaT and invalid code points included), in any layout."""
    dt = draw(_DTYPES)
    if draw(st.booleans()):
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
    else:  # about SMALL_INLINE_BYTES: one item under, at, one item over
        target = draw(st.sampled_from([SMALL - dt.itemsize, SMALL, SMALL + dt.itemsize, 3 * SMALL]))
        shape = (max(1, target // dt.itemsize),)
    layout = draw(st.sampled_from(_LAYOUTS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if layout == "broadcast" and shape:
        row = np.frombuffer(rng.bytes(dt.itemsize * shape[-1]), dt)
        return np.broadcast_to(row, shape)  # zero strides
    big = tuple(2 * s + 1 for s in shape)  # room for a strided or reversed view
    base = np.frombuffer(rng.bytes(dt.itemsize * int(np.prod(big)) + 1), np.uint8)
    if layout == "unaligned":
        n = int(np.prod(shape))
        return base[1:1 + n * dt.itemsize].view(dt).reshape(shape)
    full = base[:-1].view(dt).reshape(big)
    if layout == "strided":
        return full[(*(slice(0, 2 * s, 2) for s in shape), ...)]
    if layout == "reversed":
        return full[(*(slice(s - 1, None, -1) if s else slice(0, 0) for s in shape), ...)]
    a = full[(*(slice(0, s) for s in shape), ...)]  # (...: a 0-d array, not a scalar)
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout == "transposed":
        return a.T
    return np.ascontiguousarray(a)


def _wire_dtype(dt: np.dtype) -> np.dtype:
    """What a dtype comes back as: a structured dtype as raw bytes (its fields are not on
    the wire: docs/client.md, "Inputs"), anything else as itself."""
    return np.dtype(f"V{dt.itemsize}") if dt.names else dt


def _assert_same(got: np.ndarray, sent: np.ndarray, what: str) -> None:
    assert got.dtype == _wire_dtype(sent.dtype), f"{what}: dtype {got.dtype} != {sent.dtype}"
    assert got.shape == sent.shape, f"{what}: shape {got.shape} != {sent.shape}"
    assert got.tobytes() == np.ascontiguousarray(sent).tobytes(), f"{what}: bytes differ"


_NAMES = st.text(min_size=1, max_size=8)  # any code points but surrogates: NUL, emoji, ...


def test_every_dtype_shape_and_layout_round_trips_on_every_path(cluster):
    """A property test: random requests (one to three inputs, random names) through an echo
    worker that batches, on five paths: inline, auto (small inline, larger in temporary
    slots), shared memory only, shared memory with every output in the worker's ring, and
    pinned (the local link); with shared memory, also from `client.alloc` buffers (by
    reference; the echo hands the client's own slot back).  Each comes back bit for bit."""
    cluster.broker()
    cluster.worker("echo", "--max-batch", "4", "--direct")
    paths = {
        "inline": (dict(transport="inline"), "auto"),
        "auto": (dict(), "auto"),
        "shm": (dict(transport="shm"), "auto"),
        "shm-reply": (dict(), "shm"),
        "pinned": (dict(pin=True), "auto"),
    }
    clients = {name: Client(cluster.frontend, timeout=20, **kw) for name, (kw, _) in paths.items()}
    try:
        wait_service(clients["inline"], "echo")

        @settings(max_examples=60, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(path=st.sampled_from(sorted(paths)),
               inputs=st.dictionaries(_NAMES, _arrays(), min_size=1, max_size=3),
               pooled=st.sampled_from([None, "whole", "view"]))
        @example(path="shm", inputs={"x": np.arange(6.0).reshape(2, 3)}, pooled="view")
        def round_trip(path, inputs, pooled):
            c = clients[path]
            sent = inputs
            if pooled is not None and c.uses_shm:
                # By reference: in a `client.alloc` buffer, whole or a view of one at an
                # offset into its slot (small ones are still copied and sent inline).
                sent = {}
                for name, a in inputs.items():
                    buf = c.alloc(a.shape if pooled == "whole" else (2, *a.shape), a.dtype)
                    dst = buf if pooled == "whole" else buf[1, ...]  # (a 0-d view, not a scalar)
                    dst[...] = a
                    sent[name] = dst
            with c.infer("echo", sent, reply=paths[path][1]) as r:
                assert sorted(r) == sorted(inputs)
                for name, sent in inputs.items():
                    _assert_same(r[name], sent, f"{path} {name!r}")

        round_trip()
        assert clients["pinned"].pinned("echo"), "the pinned client's requests went through the broker"
    finally:
        for c in clients.values():
            c.close()


def _assert_outputs(r, x, what: str) -> None:
    for name, want in layouts_expected(x).items():
        got = r[name]
        assert got.dtype == want.dtype and got.shape == want.shape, f"{what} {name}: {got.dtype}{got.shape}"
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{what} {name}: bytes differ"


def test_outputs_in_every_layout_arrive_as_the_model_computed_them(cluster):
    """A model's outputs in Fortran order, reversed, strided, broadcast, 0-d, empty, of
    other dtypes, and views of its input (tests/e2e/layouts_model.py), on every path and
    reply mode, alone and in batches of concurrent requests from several clients."""
    cluster.broker()
    cluster.worker("layouts_model:factory", "--max-batch", "8", "--direct")
    paths = [dict(transport="inline"), dict(), dict(transport="shm"), dict(pin=True)]
    rng = np.random.default_rng(7)
    for kw in paths:
        with Client(cluster.frontend, timeout=20, **kw) as c:
            wait_service(c, "layouts")
            for shape, dt in [((2,), np.float32), ((5, 3), ">f8"), ((1025,), np.float32), ((3, 300), np.int8),
                              ((2, 3, 4), np.complex64)]:
                x = (rng.standard_normal(shape) * 10).astype(dt)
                for reply in ("auto", "shm", "inline"):
                    with c.infer("layouts", {"x": x}, reply=reply) as r:
                        _assert_outputs(r, x, f"{kw} {shape} {dt} reply={reply}")

    async def concurrent():
        clients = [AsyncClient(cluster.frontend, timeout=30, **kw) for kw in paths]
        xs = [rng.standard_normal((int(n),)).astype(np.float32) for n in rng.integers(2, 3000, 8)]
        sizes = []

        async def one(k):
            x = xs[(k // 8) % len(xs)]  # runs of eight requests of one signature
            with await clients[k % len(clients)].infer("layouts", {"x": x}) as r:
                _assert_outputs(r, x, f"request {k}")
                sizes.append(r.timing["batch"])

        try:
            await asyncio.gather(*(one(k) for k in range(160)))
        finally:
            for c in clients:
                await c.close()
        return sizes

    sizes = asyncio.run(concurrent())
    assert max(sizes) > 1, "no batch formed: the split of a batch's outputs went untested"


def test_a_batching_worker_gives_every_client_its_own_rows(cluster):
    """Concurrent clients on every path send requests of mixed shapes and dtypes, each
    tagged: a batching echo stacks only requests of one signature, and each request gets
    its own rows back, whatever batch it was in."""
    cluster.broker()
    cluster.worker("echo", "--max-batch", "8", "--direct")
    shapes = [(3,), (2, 3), (1500,), (100, 30)]
    dtypes = [np.float32, np.int64, np.uint8, ">f2"]

    async def scenario():
        clients = [AsyncClient(cluster.frontend, timeout=30, **kw)
                   for kw in (dict(transport="inline"), dict(), dict(transport="shm"), dict(pin=True))]
        sizes = []

        async def one(k):
            rng = np.random.default_rng(k)
            sig = k // 8  # runs of eight requests of one signature, from the four clients
            x = rng.integers(0, 100, shapes[sig % len(shapes)]).astype(dtypes[(sig // 4) % len(dtypes)])
            tag = np.array([k], np.int64)
            with await clients[k % len(clients)].infer("echo", {"x": x, "tag": tag}) as r:
                assert r["tag"][0] == k
                _assert_same(r["x"], x, f"request {k}")
                sizes.append(r.timing["batch"])

        try:
            await asyncio.gather(*(one(k) for k in range(320)))
        finally:
            for c in clients:
                await c.close()
        return sizes

    sizes = asyncio.run(scenario())
    assert max(sizes) > 1, "no batch formed"


class _TwiceNamed(Mapping):
    """A Mapping (not a dict) that names one input twice."""

    def __init__(self, items):
        self._items = items

    def __getitem__(self, key):
        return dict(self._items)[key]

    def __iter__(self):
        return (k for k, _ in self._items)

    def __len__(self):
        return len(self._items)


@pytest.mark.parametrize("transport", ["inline", "auto"])
def test_inputs_that_cannot_round_trip_are_refused_before_anything_is_sent(cluster, transport):
    """What would not come back as it was sent raises `InvalidInput` before a byte is sent,
    holds no slot, and the client serves on: a masked array hiding values (its bytes went,
    not its mask: the model computed on the hidden values), a nested torch tensor (raised
    torch's RuntimeError), one name twice (sent, and refused by the broker as a protocol
    error "if client, broker and worker run the same version, this is a bug").  What does
    come back: a masked array that hides nothing and an np.matrix, as their plain arrays."""
    torch = pytest.importorskip("torch")
    cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=20, transport=transport) as c:
        wait_service(c, "echo")
        big = np.arange(5000, dtype=np.float32)  # a temporary slot, with shared memory
        with pytest.raises(InvalidInput, match="masked array with 1 masked"):
            c.infer("echo", {"big": big, "m": np.ma.array([1.0, 2.0, 3.0], mask=[0, 1, 0])})
        with warnings.catch_warnings():  # (torch's "prototype stage", numpy's "not the recommended way")
            warnings.simplefilter("ignore")
            nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
            mat = np.asmatrix(np.arange(6).reshape(2, 3))
        with pytest.raises(InvalidInput, match="nested torch tensor"):
            c.infer("echo", {"big": big, "n": nested})
        with pytest.raises(InvalidInput, match="'a' appears twice"):
            c.infer("echo", _TwiceNamed([("a", big), ("a", np.zeros(3))]))
        if c.uses_shm:
            assert c.pool.in_use() == 0
        plain = {"m": np.ma.array([1.0, 2.0], mask=[0, 0]), "mat": mat}
        with c.infer("echo", plain) as r:
            _assert_same(r["m"], np.asarray(plain["m"]), "m")
            _assert_same(r["mat"], np.asarray(plain["mat"]), "mat")
            assert type(r["mat"]) is np.ndarray


def test_a_torch_model_takes_inputs_wherever_their_bytes_lie(cluster):
    """torch takes a tensor's items to be aligned to their size; numpy does not, and an
    inline input starts wherever its frame lies in the receive buffer (a reference into a
    client's slot, wherever the client's view starts).  A small complex128 tensor, 8 bytes
    off a 16-byte boundary there, crashed a torch worker (SIGSEGV), and the broker's retry
    the next one: `np.ones(3, np.complex128)` took the whole service down.  Now it is
    copied where torch wants it, on every path, and the workers serve on; and so are the
    client's complex outputs."""
    pytest.importorskip("torch")
    cluster.broker()
    workers = [cluster.worker("layouts_model:torch_clone", "--direct") for _ in range(2)]
    for kw in (dict(), dict(transport="inline"), dict(transport="shm"), dict(pin=True)):
        with Client(cluster.frontend, timeout=20, **kw) as c:
            wait_service(c, "tclone")
            cases = [np.ones(3, np.complex128), np.arange(5, dtype=">c16") * 1j, np.arange(7, dtype=np.float64)]
            if c.uses_shm:  # by reference, 8 bytes into a slot
                buf = c.alloc((64 + 48,), np.uint8)
                view = buf[8:8 + 48].view(np.complex128)
                view[...] = [1 + 2j, 3 - 4j, 5j]
                cases.append(view)
            for x in cases:
                with c.infer("tclone", {"x": x}) as r:
                    want = x.astype(x.dtype.newbyteorder("="))
                    _assert_same(r["x"], want, f"{kw} {x.dtype}{x.shape} x")
                    _assert_same(r["two"], want * 2, f"{kw} {x.dtype}{x.shape} two")
                    for name in ("x", "two"):
                        # The client's side of it: an inline output lies anywhere in the
                        # frame it came in, and torch.from_numpy(out).clone() of a complex
                        # one 8 bytes off crashed the client (its outputs are copied then).
                        if r[name].dtype.kind == "c":
                            assert r[name].ctypes.data % r[name].dtype.itemsize == 0, (kw, name)
    assert [w.p.poll() for w in workers] == [None, None]
