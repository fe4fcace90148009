"""A streaming model for tests/e2e/test_models_docs.py, loaded as `--model docs_model:stream`
(a plain function with the optional attributes docs/models.md lists): it yields x + i for
i < 3; x[0] says what else to do: -1 refuses the request (`InvalidInput`) before any
partial, -2 refuses it after two, -3 calls sys.exit() after one."""
import sys

import numpy as np

from gpu_worker.models import InvalidInput


def stream(device="cpu"):
    def run(batch):
        x = batch["x"]
        code = float(x.ravel()[0])
        if code == -1:
            raise InvalidInput("docs_model: x[0] = -1 is refused")
        for i in range(3):
            if code == -2 and i == 2:
                raise InvalidInput("docs_model: refused after two partials")
            if code == -3 and i == 1:
                sys.exit(3)
            yield {"y": x + i}

    run.name = "docstream"
    run.streaming = True
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(2, np.float32)}
    return run
