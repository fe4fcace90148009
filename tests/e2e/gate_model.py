"""A model for tests whose progress the test controls: each call reads one byte from the FIFO
named by $GATE_FIFO before echoing its inputs, so a test decides exactly when a request
finishes (no sleeps).  Loaded as `--model gate_model:factory` with this folder on PYTHONPATH."""
import os


def factory(device: str = "cpu"):
    path = os.environ["GATE_FIFO"]
    fd = os.open(path, os.O_RDONLY)  # blocks until the test opens the write end

    def gate(inputs):
        os.read(fd, 1)
        return dict(inputs)

    gate.name = "gate"
    return gate
