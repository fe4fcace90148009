"""A model whose loading the test holds: its factory appends a line to $LOADING_FILE, then
waits (in Python, a 10 ms step at a time, so that the signal handlers of the worker run as
they would in a model that computes) until the file $LOADING_RELEASE exists, so a test acts on
a worker still loading its model without a sleep of its own.  Loaded as
`--model loading_model:factory`, with this folder on PYTHONPATH; it serves as echo."""
import os
import time


def factory(device: str = "cpu"):
    with open(os.environ["LOADING_FILE"], "a") as f:
        f.write("loading\n")
    while not os.path.exists(os.environ["LOADING_RELEASE"]):
        time.sleep(0.01)  # the model "loading": what the test holds

    def loading(inputs):
        return dict(inputs)

    loading.name = "loading"
    return loading
