"""What docs/models.md promises someone who writes a model for ``python -m gpu_worker --model
package.module:factory``, checked in-process against the doc (the loader, the backends the
worker makes, the worker's start): the doc's own examples, what each kind of factory result
becomes, how a batch is passed to a forward, the optional attributes, the defaults, warm-up
and ``--no-warmup``, and the shipped models' table.  What the wire does with a model's errors
is tests/e2e/test_model_faults.py's."""
from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gpu_worker.backends import make_backend, warmup
from gpu_worker.models import (SHIPPED_MODELS, CallableModel, InvalidInput, ModelBase, ModelLoadError,
                               TorchModuleModel, load_model)

torch = pytest.importorskip("torch")

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"

ZOO = textwrap.dedent(
    '''
    from typing import Any, Mapping
    import typing

    import numpy as np
    import torch


    def full_function(device="cpu"):
        # A plain function carrying every optional attribute the doc lists for (3).
        def halve(batch):
            x = batch["x"]
            assert isinstance(x, np.ndarray), type(x)  # (3) is "fn(dict of np.ndarray)"
            return {"y": x.astype(np.float64) / 2}
        halve.name = "halve"
        halve.batchable = True
        halve.streaming = False
        halve.cost = lambda inputs: 7.0
        halve.example_inputs = lambda: {"x": np.ones(3, np.float32)}
        halve.inputs = {"x": ("<f4", (None,))}
        return halve


    class FullModule(torch.nn.Module):
        # An nn.Module carrying every optional attribute the doc lists for (2).
        name = "fullmod"
        batchable = True
        streaming = False
        inputs = {"x": ("<f4", (None,))}

        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.5)   # eval mode or not shows

        def cost(self, inputs):
            return 5.0

        def example_inputs(self):
            return {"x": np.ones(3, np.float32)}

        def forward(self, x):
            return self.drop(x) * 2


    def full_module():
        return FullModule()


    class Masked(torch.nn.Module):
        def forward(self, x, mask=None):          # one tensor: positionally, whatever its name
            return x + (0 if mask is None else 100)


    def masked():
        return Masked()


    class TwoKw(torch.nn.Module):
        def forward(self, a, b):                  # several tensors as keywords
            return {"d": a - b}


    def two_kw():
        return TwoKw()


    class AbcMapping(torch.nn.Module):
        def forward(self, inputs: Mapping):
            return {"y": inputs["x"] + 1}


    class TypingMapping(torch.nn.Module):
        def forward(self, inputs: typing.Mapping[str, Any]):
            return {"y": inputs["x"] + 1}


    class DictOfTensors(torch.nn.Module):
        def forward(self, inputs: "dict[str, torch.Tensor]"):
            return {"y": inputs["x"] + 1}


    def abc_mapping():
        return AbcMapping()


    def typing_mapping():
        return TypingMapping()


    def dict_of_tensors():
        return DictOfTensors()


    class Streamer(torch.nn.Module):
        streaming = True
        batchable = False
        example_inputs = {"x": np.arange(4, dtype=np.float32)}

        def forward(self, x):
            for i in range(3):
                yield x + i                        # a lone tensor per partial: "output"


    def streamer():
        return Streamer()


    def stream_fn():
        def count(batch):
            for i in range(3):
                yield batch["x"] + i
        count.streaming = True
        count.batchable = False
        return count


    calls = []


    def unbatched():
        def one(batch):
            calls.append(len(batch["x"]))
            return {"y": batch["x"]}
        one.batchable = False
        return one


    class Doubler:                                 # a callable object, no name of its own
        def __call__(self, batch):
            return {"y": batch["x"] * 2}


    def callable_object():
        return Doubler()


    def no_examples():
        return lambda batch: {"y": batch["x"]}


    def _scaled(batch, k):
        return {"y": batch["x"] * k}


    def partial():                                  # anonymous too: named after the factory
        import functools
        return functools.partial(_scaled, k=2)


    def bad_examples():
        f = lambda batch: {"y": batch["x"].reshape(len(batch["x"]), 2, 2)}
        f.example_inputs = {"x": np.ones(3, np.float32)}   # 3 cannot be 2x2
        return f
    '''
)


def _doc_examples() -> str:
    """The doc's example factories (the python blocks that define one), as one module."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    code = [textwrap.dedent(b) for b in blocks if "def make_" in b]
    assert len(code) >= 3, "the doc's factory examples moved: update this test"
    return "import numpy as np\nimport torch\n\n" + "\n\n".join(code)


@pytest.fixture
def zoo(tmp_path, monkeypatch):
    pkg = tmp_path / "docmodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "zoo.py").write_text(ZOO)
    (pkg / "examples.py").write_text(_doc_examples())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "docmodels.zoo"
    for mod in ("docmodels.zoo", "docmodels.examples", "docmodels"):
        sys.modules.pop(mod, None)


def _served(model, *requests):
    """What the worker's backend for ``model`` returns for ``requests`` (one batch)."""
    return make_backend(model, "cpu").run(list(requests))


# ------------------------------------------------------------------ the doc's own examples


def test_the_docs_examples_load_under_the_names_it_gives_and_serve_what_it_says(zoo):
    x = np.arange(4, dtype=np.float32)
    doubler = load_model("docmodels.examples:make_model", "cpu")
    assert doubler.name == "doubler" and type(doubler).__name__ == "Doubler"  # used as is
    assert _served(doubler, {"x": x})[0]["y"].tolist() == (x * 2).tolist()
    assert set(warmup(make_backend(doubler, "cpu"), doubler)) == {1}

    affine = load_model("docmodels.examples:make_module", "cpu")
    assert isinstance(affine, TorchModuleModel) and affine.name == "affine"  # "not make_module"
    assert list(_served(affine, {"x": x})[0]) == ["output"]  # input "x" -> output "output"
    assert _served(affine, {"x": x})[0]["output"].tolist() == (x * 3 + 1).tolist()

    seq = load_model("docmodels.examples:make_seq", "cpu")
    assert seq.name == "sequential"
    for name in ("x", "input", "features"):  # "any one input name"
        assert _served(seq, {name: x})[0]["output"].shape == (2,)

    scale = load_model("docmodels.examples:make_scale", "cpu")
    backend = make_backend(scale, "cpu")
    assert backend.takes_meta
    outs = backend.run([{"x": x}, {"x": x}], meta=[{"scale": 3}, {}])
    assert outs[0]["x"].tolist() == (x * 3).tolist() and outs[1]["x"].tolist() == x.tolist()


# ------------------------------------------------------------------ what a factory may return


def test_a_function_carrying_every_optional_attribute_is_still_a_numpy_callable(zoo):
    # (3) "Any other callable fn(dict of np.ndarray) -> dict of np.ndarray ... optional
    # attributes on the module or function override the defaults".
    m = load_model(f"{zoo}:full_function", "cpu")
    assert m.name == "halve" and m.framework == "numpy", (type(m).__name__, getattr(m, "framework", None))
    assert m.cost({"x": np.ones(3, np.float32)}) == 7.0
    out = _served(m, {"x": np.full(3, 4, np.float32)})[0]
    assert out["y"].dtype == np.float64 and out["y"].tolist() == [2.0, 2.0, 2.0]


def test_an_nn_module_carrying_every_optional_attribute_is_still_wrapped(zoo):
    # (2) "wrapped in TorchModuleModel, put in eval mode with gradients off ... called with
    # the batch as keyword arguments; a returned tensor becomes the output 'output'".
    m = load_model(f"{zoo}:full_module", "cpu")
    assert isinstance(m, TorchModuleModel), type(m).__name__
    assert m.name == "fullmod" and not m.module.training
    assert m.cost({"x": np.ones(3, np.float32)}) == 5.0 and m.inputs == {"x": ("<f4", (None,))}
    x = np.ones(64, np.float32)
    assert _served(m, {"x": x})[0]["output"].tolist() == (x * 2).tolist()  # no dropout: eval mode


# ------------------------------------------------------------------ how a batch reaches forward


def test_one_tensor_goes_positionally_to_a_forward_with_an_optional_second_parameter(zoo):
    m = load_model(f"{zoo}:masked", "cpu")
    assert _served(m, {"image": np.zeros(2, np.float32)})[0]["output"].tolist() == [0.0, 0.0]


def test_several_tensors_go_as_keywords(zoo):
    m = load_model(f"{zoo}:two_kw", "cpu")
    out = _served(m, {"b": np.ones(2, np.float32), "a": np.full(2, 3, np.float32)})
    assert out[0]["d"].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("factory", ["abc_mapping", "typing_mapping", "dict_of_tensors"])
def test_a_forward_annotated_as_a_mapping_gets_the_dict(zoo, factory):
    m = load_model(f"{zoo}:{factory}", "cpu")
    assert _served(m, {"x": np.zeros(2, np.float32)})[0]["y"].tolist() == [1.0, 1.0]


# ------------------------------------------------------------------ optional attributes


@pytest.mark.parametrize("factory, wrapper", [("streamer", TorchModuleModel), ("stream_fn", CallableModel)])
def test_a_streaming_module_or_function_yields_its_partials_in_order(zoo, factory, wrapper):
    m = load_model(f"{zoo}:{factory}", "cpu")
    assert isinstance(m, wrapper) and m.streaming and not m.batchable
    x = np.arange(4, dtype=np.float32)
    parts = list(make_backend(m, "cpu").run_stream({"x": x}))
    assert [p["output"].tolist() for p in parts] == [(x + i).tolist() for i in range(3)]


def test_batchable_false_runs_once_per_request(zoo):
    m = load_model(f"{zoo}:unbatched", "cpu")
    calls = sys.modules["docmodels.zoo"].calls
    x = np.zeros(2, np.float32)
    assert len(_served(m, {"x": x}, {"x": x}, {"x": x})) == 3 and calls == [1, 1, 1]


def test_model_base_defaults():
    class Bare(ModelBase):
        def __call__(self, batch):
            return dict(batch)

    m = Bare()
    assert (m.batchable, m.streaming, m.inputs, m.outputs, m.framework) == (True, False, None, None, "torch")
    assert m.cost({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.uint8)}) == 14.0  # input bytes
    assert issubclass(InvalidInput, ValueError)


def test_a_callable_objects_name_is_its_class_name_lowercased(zoo):
    m = load_model(f"{zoo}:callable_object", "cpu")
    assert isinstance(m, CallableModel) and m.name == "doubler"
    assert load_model(f"{zoo}:partial", "cpu").name == "partial"  # anonymous: the factory's name


def test_a_module_that_does_not_import_chains_the_original_exception(zoo, tmp_path):
    (tmp_path / "docmodels" / "broken.py").write_text("raise ImportError('no weights lib')\n")
    with pytest.raises(ModelLoadError, match="no weights lib") as info:
        load_model("docmodels.broken:make", "cpu")
    assert isinstance(info.value.__cause__, ImportError)
    sys.modules.pop("docmodels.broken", None)


# ------------------------------------------------------------------ warm-up and --no-warmup


class _Upstream:  # never connected: the worker's start is what is checked
    def close(self, *a, **k):
        pass


def _worker(model: str, warm: bool):
    from gpu_worker.worker import Worker, WorkerConfig

    return Worker(WorkerConfig(broker="ipc:///nonexistent", model=model, device="cpu", warmup=warm,
                               out_capacity=1 << 20), upstream=_Upstream())


def test_without_example_inputs_the_warm_up_is_skipped(zoo):
    with _worker(f"{zoo}:no_examples", warm=True) as w:
        assert w.service == "no_examples"


def test_a_failing_warm_up_stops_the_start_and_no_warmup_skips_it(zoo):
    from gpu_worker.__main__ import build_parser, model_config
    from gpu_worker.worker import WarmupError

    with pytest.raises(WarmupError, match="reshape"):
        _worker(f"{zoo}:bad_examples", warm=True)
    args = build_parser().parse_args(["--model", f"{zoo}:bad_examples", "--no-warmup"])
    assert model_config(args)["warmup"] is False
    with _worker(f"{zoo}:bad_examples", warm=False) as w:
        assert w.service == "bad_examples"


# ------------------------------------------------------------------ the shipped models' table


def test_the_shipped_models_are_as_the_table_says():
    from gpu_worker.signature import mismatch, parse_inputs

    table = {"echo": ("numpy", True, False), "cartoon": ("torch", True, False),
             "convnet": ("torch", True, False), "chunks": ("numpy", False, True)}
    assert set(SHIPPED_MODELS) == set(table)
    models = {name: load_model(name, "cpu") for name in table}
    for name, m in models.items():
        assert (m.framework, m.batchable, m.streaming) == table[name], name
        ex = m.example_inputs()  # one request, and it fits what the model declares
        sig = parse_inputs(m.inputs)
        if sig is not None:
            tensors = [type("T", (), {"name": k, "dtype": v.dtype.str, "shape": v.shape}) for k, v in ex.items()]
            assert mismatch(sig, tensors) is None, name

    image = np.zeros((40, 30, 3), np.uint8)
    assert models["cartoon"].cost({"image": image}) == models["convnet"].cost({"image": image}) == 40 * 30  # pixels
    x = np.zeros((8, 5), np.float32)
    assert models["echo"].cost({"x": x}) == models["chunks"].cost({"x": x}) == x.nbytes  # bytes
    assert models["cartoon"].outputs == {"image": ("|u1", (None, None, 3))}
    assert models["convnet"].outputs == {"logits": ("<f4", (1000,))}

    # convnet: H, W >= 32 -> logits float32 (1000,)
    out = _served(models["convnet"], {"image": np.zeros((32, 32, 3), np.uint8)})[0]["logits"]
    assert out.shape == (1000,) and out.dtype == np.float32
    # chunks: x in min(4, len(x)) pieces along its first axis; one for a 0-d or an empty x
    for x, n in [(np.arange(10 * 2, dtype=np.float32).reshape(10, 2), 4), (np.arange(3, dtype=np.float32), 3),
                 (np.float32(7.0).reshape(()), 1), (np.zeros((0, 2), np.float32), 1)]:
        parts = [p["x"] for p in make_backend(models["chunks"], "cpu").run_stream({"x": x})]
        assert len(parts) == n and np.array_equal(np.concatenate(parts) if x.ndim else parts[0], x), x.shape
