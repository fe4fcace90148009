"""An echo in a worker whose ownership check is switched off (`gpu_worker.planes.check_owner`
made a no-op as this module loads), for the test that the hostile peer's check catches a
forged descriptor that is served.  Loaded as `--model trusting_model:factory` with this
folder on PYTHONPATH."""
import numpy as np

from gpu_worker import planes

planes.check_owner = lambda req, segment: None  # the breach the hostile peer must notice


def factory(device: str = "cpu"):
    def run(inputs):
        return {k: np.array(v, copy=True) for k, v in inputs.items()}

    run.name = "trusting"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(16, np.uint8)}
    return run
