"""Models that misbehave on demand, for tests of what a model can do to the worker and to
other clients' requests (tests/e2e/test_model_faults.py).  Loaded as `--model
faulty_model:<factory>`, with this folder on PYTHONPATH.  Each request says what to do in its
`meta` ("do"); anything else is served: y = x + 1.

- `batched`: a batchable model.  do = "raise" (ValueError), "refuse" (`models.InvalidInput`), "exit" (SystemExit), "genexit"
  (GeneratorExit), "many" (300 outputs), "badname" (an output named 0), "deep" (a 41-d
  output), "half" (a good first output, then an object array), "v0" (a zero-size item
  dtype), "crash" (the worker process exits at once), "segv" (a segmentation fault in native code),
  "surrogate" (a message with a lone surrogate), "badstr" (an exception whose str() raises),
  "longmsg" (a 2 MiB message), "longname" (an output named by 2 MiB), "surrname" (an output
  name with a lone surrogate), "emptyhuge" (an empty output of shape (0, 1 << 40) float32),
  "list" (a list, not a dict), "noaxis" (an output without the batch's leading axis),
  "objects" and "intname" (for the whole batch it is in, whatever its size: an object array,
  an output named 1);
  slow = 1
  makes the batch
  take 0.15 s (slow = 0.03: 0.03 s; any time over `leases.LONG_BATCH_S` makes it a batch
  predicted long, run on the compute thread).  `batched_keeper`: the same, returning a view of one buffer it keeps.
- `keeper`: returns a view of one buffer it keeps and fills again on every call (the
  preallocated `out=` pattern).
- `streaming`: yields `x + i` for i < 4; do = "raise" raises after 2 partials ("surrogate":
  with a lone surrogate in its message), "big" yields five 20 MB partials at once, "badtype"
  yields a list as its third partial, "die" ends the worker process after 2 partials,
  "many" yields meta["n"] small partials (y = [i]) as fast as it can, "for" one small
  partial after another, as fast as it can, for meta["s"] seconds.
"""
import os
import time

import numpy as np

from gpu_worker.models import InvalidInput, ModelBase


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


class Batched(ModelBase):
    name = "batched"
    framework = "numpy"
    batchable = True

    def __init__(self, device="cpu", keep=False):
        self.device = device
        self.keep = keep
        self.buf = None

    def __call__(self, batch, meta):
        x = batch["x"]
        n = len(x)
        slow = [m["slow"] for m in meta if m.get("slow")]
        if slow:
            # predicted slow: every batch goes to the compute thread
            time.sleep(0.15 if max(slow) is True or max(slow) == 1 else float(max(slow)))
        for m in meta:
            do = m.get("do")
            if do == "raise":
                raise ValueError("faulty_model: told to raise")
            if do == "refuse":
                raise InvalidInput("faulty_model: this request's x is refused")
            if do == "crash":
                os._exit(70)
            if do == "segv":
                import ctypes

                ctypes.string_at(0)  # a crash in native code: SIGSEGV
            if do == "exit":
                raise SystemExit(3)
            if do == "genexit":
                raise GeneratorExit()
            if do == "many" and n == 1:
                return {f"o{i}": x.copy() for i in range(300)}
            if do == "badname" and n == 1:
                return {0: x.copy()}
            if do == "emptyname" and n == 1:
                return {"": x.copy()}
            if do == "deep" and n == 1:
                return {"y": x.reshape((1,) * 41 + x.shape[1:])}
            if do == "half" and n == 1:
                return {"y": x + 1, "z": np.array([[object()]], dtype=object)}
            if do == "v0" and n == 1:
                return {"y": np.zeros((1, 3), dtype="V0")}
            if do == "surrogate":  # a non-UTF-8 file name, as Python decodes it
                raise ValueError("cannot open " + os.fsdecode(b"/data/\xff.bin"))
            if do == "badstr":
                raise Unprintable()
            if do == "longmsg":
                raise ValueError("x" * (2 << 20))
            if do == "longname" and n == 1:
                return {"n" * (2 << 20): x + 1}
            if do == "surrname" and n == 1:
                return {os.fsdecode(b"y\xff"): x + 1}
            if do == "list" and n == 1:
                return [x + 1]
            if do == "noaxis" and n == 1:
                return {"y": np.zeros(5, np.float32)}
            if do == "objects":
                return {"y": np.array([object()] * n, dtype=object)}
            if do == "intname":
                return {1: x + 1}
            if do == "emptyhuge" and n == 1:  # empty, but a shape over P.MAX_TENSOR_BYTES
                return {"y": np.lib.stride_tricks.as_strided(x, (1, 0, 1 << 40), (0, 0, 0))}
        if self.keep:  # one buffer, filled again on every call (the preallocated `out=` pattern)
            if self.buf is None or self.buf.shape != x.shape:
                self.buf = np.empty_like(x)
            np.add(x, 1, out=self.buf)
            return {"y": self.buf}
        return {"y": x + 1}

    def example_inputs(self):
        return {"x": np.zeros(4, np.float32)}


def batched(device="cpu"):
    return Batched(device)


def batched_keeper(device="cpu"):
    return Batched(device, keep=True)


class Keeper(ModelBase):
    name = "keeper"
    framework = "numpy"
    batchable = False

    def __init__(self, device="cpu"):
        self.device = device
        self.buf = None

    def __call__(self, batch):
        x = batch["x"]
        if self.buf is None or self.buf.shape != x.shape:
            self.buf = np.empty_like(x)
        np.copyto(self.buf, x)
        return {"y": self.buf}

    def example_inputs(self):
        return {"x": np.zeros((1, 4), np.float32)}


def keeper(device="cpu"):
    return Keeper(device)


class Streaming(ModelBase):
    name = "streaming"
    framework = "numpy"
    batchable = False
    streaming = True

    def __init__(self, device="cpu"):
        self.device = device

    def __call__(self, batch, meta):
        do = meta.get("do")
        if do == "big":  # five 20 MB partials, at once
            for i in range(5):
                yield {"y": np.full((1, 5_000_000), i, np.float32)}
            return
        if do == "many":  # more partials than a client that stopped reading has room for
            for i in range(int(meta["n"])):
                yield {"y": np.array([i], np.int64)}
            return
        if do == "for":  # a stream of a given length whose model takes no time
            one, end = np.ones(1, np.int64), time.monotonic() + float(meta["s"])
            while time.monotonic() < end:
                yield {"y": one}
            return
        for i in range(4):
            if do == "raise" and i == 2:
                raise RuntimeError("faulty_model: stream told to raise")
            if do == "surrogate" and i == 2:
                raise RuntimeError("cannot open " + os.fsdecode(b"/data/\xff.bin"))
            if do == "badtype" and i == 2:
                yield [1, 2, 3]
                continue
            if do == "die" and i == 2:
                time.sleep(0.5)  # (its I/O thread sends the partials before)
                os._exit(1)  # the worker process dies mid-stream
            yield {"y": batch["x"] + i}

    def example_inputs(self):
        return {"x": np.zeros(4, np.float32)}


def streaming(device="cpu"):
    return Streaming(device)


class TorchAdd(ModelBase):
    """A torch model with no declared inputs: y = x + 1, in torch."""

    name = "torchadd"
    framework = "torch"
    batchable = True

    def __init__(self, device="cpu"):
        self.device = device

    def __call__(self, batch):
        return {"y": batch["x"] + 1}

    def example_inputs(self):
        return {"x": np.zeros(4, np.float32)}


def torchadd(device="cpu"):
    return TorchAdd(device)


class TorchStream(TorchAdd):
    """The same, streamed: y = x + i for i < 2."""

    name = "torchstream"
    batchable = False
    streaming = True

    def __call__(self, batch):
        for i in range(2):
            yield {"y": batch["x"] + i}


def torchstream(device="cpu"):
    return TorchStream(device)


class Forking(ModelBase):
    """Forks a helper that computes y = x + 1 and sends it back through a pipe, then leaves
    as `meta["do"]` says: "exit" (`sys.exit(0)`: the common mistake, `os._exit` is right in
    a forked child), "raise" (a ValueError), "return" (returns to its caller)."""

    name = "forking"
    framework = "numpy"
    batchable = False

    def __init__(self, device="cpu"):
        self.device = device

    def __call__(self, batch, meta):
        import sys

        x = np.asarray(batch["x"]).copy()
        do = meta.get("do", "exit")  # (not batchable: its request's own dict)
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            os.write(wfd, (x + 1).tobytes())
            os.close(wfd)
            if do == "exit":
                sys.exit(0)
            if do == "raise":
                raise ValueError("forking: the child raised")
            return {"y": x}
        os.close(wfd)
        data = b""
        while True:
            chunk = os.read(rfd, 1 << 16)
            if not chunk:
                break
            data += chunk
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
        return {"y": np.frombuffer(data, x.dtype).reshape(x.shape), "status": np.array([status])}


def forking(device="cpu"):
    return Forking(device)


class BadCost(Batched):
    """`batched` whose cost() raises (meta has no part in it: every request)."""

    name = "badcost"

    def __init__(self, device="cpu", how="raise"):
        super().__init__(device)
        self.how = how

    def cost(self, inputs):
        if self.how == "nan":
            return float("nan")
        raise RuntimeError("cost() broke")


def badcost(device="cpu"):
    return BadCost(device)


def nancost(device="cpu"):
    return BadCost(device, "nan")


class InputWriter(Batched):
    """Writes to its input (y = x after x += 1 in place): a contract broken."""

    name = "inputwriter"

    def __call__(self, batch, meta=None):
        x = batch["x"]
        x += 1
        return {"y": x.copy()}


def inputwriter(device="cpu"):
    return InputWriter(device)


class TorchInputWriter(TorchAdd):
    """A torch module whose first step is in place on its input (ReLU(inplace=True) does)."""

    name = "torchwriter"

    def __call__(self, batch):
        import torch

        x = torch.as_tensor(batch["x"])
        x.add_(1)
        return {"y": x.clone()}


def torchwriter(device="cpu"):
    return TorchInputWriter(device)


class BrokenExamples(Batched):
    """example_inputs() raises (a file it reads is missing)."""

    name = "brokenexamples"

    def example_inputs(self):
        raise FileNotFoundError("examples.npz")


def brokenexamples(device="cpu"):
    return BrokenExamples(device)


class BatchOnlyFault(Batched):
    """Fails on every batch of more than one (a wrong leading axis), serves ones."""

    name = "batchfault"

    def __call__(self, batch, meta=None):
        if len(batch["x"]) > 1:
            raise ValueError("axis 0 mixed up")
        return {"y": batch["x"] + 1}


def batchfault(device="cpu"):
    return BatchOnlyFault(device)


class MisfitExamples(Batched):
    """Declares x: <f4[3]; its example_inputs() give a (5,)."""

    name = "misfit"
    inputs = {"x": ("<f4", (3,))}

    def example_inputs(self):
        return {"x": np.zeros(5, np.float32)}


def misfit(device="cpu"):
    return MisfitExamples(device)


class BatchOnlyObjects(Batched):
    """Returns an object array (outputs no reply can carry) for every batch of more than
    one, raising nothing; serves ones."""

    name = "batchobjects"

    def __call__(self, batch, meta=None):
        x = batch["x"]
        if len(x) > 1:
            return {"y": np.array([object()] * len(x), dtype=object)}
        return {"y": x + 1}


def batchobjects(device="cpu"):
    return BatchOnlyObjects(device)
