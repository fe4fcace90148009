"""A model for tests whose progress the test controls: each call reads one byte from the FIFO
named by $GATE_FIFO before answering, so a test decides exactly when a request finishes (no
sleeps).  Loaded as `--model gate_model:factory` (echoes its inputs: the reply references the
client's own memory) or `gate_model:copying` (answers copies: the reply lives in the worker's
output ring), with this folder on PYTHONPATH."""
import os

import numpy as np


def _gate(copy: bool):
    path = os.environ["GATE_FIFO"]
    entered = os.environ.get("GATE_ENTERED")  # a file that gets a line as each call reaches the gate
    fd = os.open(path, os.O_RDONLY)  # blocks until the test opens the write end

    def gate(inputs):
        if entered:
            with open(entered, "a") as f:
                f.write("entered\n")
        os.read(fd, 1)
        return {k: np.array(v, copy=True) for k, v in inputs.items()} if copy else dict(inputs)

    gate.name = "gate"
    return gate


def factory(device: str = "cpu"):
    return _gate(copy=False)


def copying(device: str = "cpu"):
    return _gate(copy=True)


def sleepy(device: str = "cpu"):
    """Sleeps x[0] seconds, then echoes: its warm-up (x = 0) is fast, so a batch of it is
    predicted fast and runs on the worker loop's thread however long x says.  Each call with
    x > 0 appends the worker's pid to $SLEEPY_LOG, so a test counts the runs."""
    import time

    log = os.environ["SLEEPY_LOG"]

    def run(inputs):
        x = np.asarray(inputs["x"])
        if x.size and float(x.flat[0]) > 0:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(float(x.flat[0]))
        return {"x": np.array(x, copy=True)}

    run.name = "sleepy"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(1)}
    return run


def held(device: str = "cpu"):
    """As `sleepy`, but a call with x[0] < 0 is held until the test releases it (one byte on
    the FIFO $GATE_FIFO: the `gate` fixture's `release()`) instead of for a fixed time, so a
    test decides when a long batch ends (no margins that a loaded machine could miss); x[0]
    > 0 sleeps that long.  Its warm-up (x = 0) is fast, so even a held call runs on the
    worker loop's own thread.  Each call with x != 0 appends the worker's pid to
    $SLEEPY_LOG.  The FIFO is opened read-write at load (Linux: it never blocks), so the
    fixture's `open()` returns at once and several workers may share one FIFO."""
    import time

    log = os.environ["SLEEPY_LOG"]
    path = os.environ.get("GATE_FIFO")
    fd = os.open(path, os.O_RDWR) if path else None

    def run(inputs):
        x = np.asarray(inputs["x"])
        t = float(x.flat[0]) if x.size else 0.0
        if t:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
        if t < 0:
            if fd is None:
                raise RuntimeError("held: x < 0 needs $GATE_FIFO")
            os.read(fd, 1)
        elif t > 0:
            time.sleep(t)
        return {"x": np.array(x, copy=True)}

    run.name = "held"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(1)}
    return run


def declared(device: str = "cpu"):
    """Halves an RGB frame; declares its input (so a wrong request is refused before it runs)
    and its output."""

    def run(inputs):
        return {"image": np.asarray(inputs["image"]) // 2}

    run.name = "declared"
    run.batchable = False
    run.inputs = {"image": ("|u1", (None, None, 3))}
    run.outputs = {"image": ("|u1", (None, None, 3))}  # shown by /v2/models/declared
    return run


def ticker(device: str = "cpu"):
    """A streaming model: x = [n, dt] yields n partials, one every dt seconds.  Each partial
    of a call with dt > 0 appends "<pid> <i>" to $SLEEPY_LOG, so a test sees how far a
    stream got (its warm-up, dt = 0, writes nothing)."""
    import time

    log = os.environ["SLEEPY_LOG"]

    def run(inputs):
        x = np.asarray(inputs["x"]).ravel()
        n, dt = int(x[0]), float(x[1])
        for i in range(n):
            if dt > 0:
                time.sleep(dt)
                with open(log, "a") as f:
                    f.write(f"{os.getpid()} {i}\n")
            yield {"x": np.array([float(i)])}

    run.name = "ticker"
    run.batchable = False
    run.streaming = True
    run.example_inputs = lambda: {"x": np.array([1.0, 0.0])}
    return run


def gated_stream(device: str = "cpu"):
    """A streaming model whose partials the test lets out one by one: a call on more than one
    element yields three partials, each a new array (x + i: a slot of the worker's output
    ring once x is over 4 KiB) after one byte on $GATE_FIFO (opened read-write at load, as
    `held` does).  Its warm-up (one element) yields at once."""
    fd = os.open(os.environ["GATE_FIFO"], os.O_RDWR)

    def run(inputs):
        x = np.asarray(inputs["x"])
        for i in range(3 if x.size > 1 else 1):
            if x.size > 1:
                os.read(fd, 1)
            yield {"x": x + i}

    run.name = "gstream"
    run.batchable = False
    run.streaming = True
    run.example_inputs = lambda: {"x": np.zeros(1, np.float32)}
    return run


def counted(device: str = "cpu"):
    """Echoes; a call with x[0] >= 0 first appends "<pid> <x[0]>" to $RUN_LOG (a test counts
    each request's runs by the tag it chose), then waits for one byte on $GATE_FIFO
    (opened read-write at load, as `held` does, so several workers may share it).  Its
    warm-up (x = -1) does neither."""
    log = os.environ["RUN_LOG"]
    fd = os.open(os.environ["GATE_FIFO"], os.O_RDWR)

    def run(inputs):
        x = np.asarray(inputs["x"])
        tag = int(x.flat[0])
        if tag >= 0:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {tag}\n")
            os.read(fd, 1)
        return {"x": np.array(x, copy=True)}

    run.name = "counted"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.full(1, -1, np.int64)}
    return run


def counted_batch(device: str = "cpu"):
    """As `counted`, but batchable: a batch first appends "<pid> <tag>" to $RUN_LOG for each
    of its requests in batch order (x = [tag], int64), then waits for one byte on
    $GATE_FIFO (one per batch; opened read-write at load, as `held` does).  So a test reads
    the exact run order, batch by batch.  Its warm-up (tag -1) does neither."""
    log = os.environ["RUN_LOG"]
    fd = os.open(os.environ["GATE_FIFO"], os.O_RDWR)

    def run(inputs):
        x = np.asarray(inputs["x"])
        tags = [int(row.flat[0]) for row in x]
        if tags[0] >= 0:
            with open(log, "a") as f:
                f.write("".join(f"{os.getpid()} {tag}\n" for tag in tags))
            os.read(fd, 1)
        return {"x": np.array(x, copy=True)}

    run.name = "counted_batch"
    run.example_inputs = lambda: {"x": np.full(1, -1, np.int64)}
    return run


def tagged(device: str = "cpu"):
    """For stream tests: x = [tag, what, ...] (int64) comes back as it is, with the worker's
    pid in `pid`, so every result names the frame it answers and who ran it.  what = 1:
    first wait for one byte on $GATE_FIFO (opened read-write at load, as `held` does, so
    several workers may share it); what = 2: raise RuntimeError.  A call with tag >= 0
    first appends "<pid> <tag>" to $RUN_LOG, if set (and to $GATE_ENTERED, if set, before it
    waits).  Its warm-up (tag = -1) does none of it."""
    log = os.environ.get("RUN_LOG")
    entered = os.environ.get("GATE_ENTERED")
    path = os.environ.get("GATE_FIFO")
    fd = os.open(path, os.O_RDWR) if path else None
    pid = np.array([os.getpid()], np.int64)

    def run(inputs):
        x = np.asarray(inputs["x"])
        tag, what = int(x.flat[0]), int(x.flat[1])
        if tag >= 0:
            if log:
                with open(log, "a") as f:
                    f.write(f"{os.getpid()} {tag}\n")
            if what == 1:
                if entered:
                    with open(entered, "a") as f:
                        f.write("entered\n")
                os.read(fd, 1)
            elif what == 2:
                raise RuntimeError(f"tagged: told to fail on frame {tag}")
        return {"x": np.array(x, copy=True), "pid": pid}

    run.name = "tagged"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.array([-1, 0], np.int64)}
    return run
