"""A batching model whose runs the test lets out one by one, for tests of which request gets
which row: each call with a row tagged (x[0] > 0) first appends a line to $GATE_ENTERED,
then waits for one byte on $GATE_FIFO (opened read-write at load, as gate_model's `held`
does); a batch with a row whose x[0] is negative raises (so the worker runs it again in
halves); each row's output ``x`` is a copy of its input.  It declares ``x`` as int64 of any
length, so a request of another dtype is refused at once, by the worker loop, even while
a batch runs (a test's barrier).  Its warm-up (x = 0) neither waits nor raises.  Loaded as
`--model rows_model:factory`."""
import os

import numpy as np


def factory(device: str = "cpu"):
    fd = os.open(os.environ["GATE_FIFO"], os.O_RDWR)
    entered = os.environ["GATE_ENTERED"]

    def run(batch):
        x = np.asarray(batch["x"])
        if (x[:, 0] != 0).any():
            with open(entered, "a") as f:
                f.write("entered\n")
            os.read(fd, 1)
        if (x[:, 0] < 0).any():
            raise ValueError("rows_model: a row asked to fail")
        return {"x": np.array(x, copy=True)}

    run.name = "rows"
    run.inputs = {"x": ("<i8", (None,))}
    run.example_inputs = lambda: {"x": np.zeros(4, np.int64)}
    return run
