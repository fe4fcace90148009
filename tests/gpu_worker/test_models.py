"""Shipped models and ``load_model``."""
from __future__ import annotations

import logging
import re
import sys
import textwrap

import numpy as np
import pytest

from gpu_worker.models import SHIPPED_MODELS, CallableModel, Model, ModelLoadError, TorchModuleModel, load_model

torch = pytest.importorskip("torch")


def run(model, **batch):
    """Call a model the way a backend does: batch arrays in, numpy out."""
    if model.framework == "torch":
        batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}
    with torch.inference_mode():
        out = model(batch)
    return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def scene(h=48, w=64, seed=0):
    """Two flat colour fields with a sharp vertical boundary, plus sensor-like noise."""
    rng = np.random.default_rng(seed)
    img = np.empty((h, w, 3), np.float32)
    img[:, : w // 2] = (200, 170, 60)
    img[:, w // 2 :] = (40, 60, 150)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def gradient(h=64, w=64, seed=1):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([x * 4, y * 4, (x + y) * 2], axis=-1) + rng.normal(0, 8, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def cartoon():
    return load_model("cartoon", "cpu")


@pytest.fixture(scope="module")
def convnet():
    return load_model("convnet", "cpu")


def n_colours(img):
    return len(np.unique(img.reshape(-1, 3), axis=0))


# ------------------------------------------------------------------------------ cartoon


def test_cartoon_keeps_shape_dtype_and_changes_the_image(cartoon):
    for h, w in [(48, 64), (37, 51)]:  # odd sizes take the pad-and-crop path
        img = gradient(h, w)
        out = run(cartoon, image=img[None])["image"]
        assert out.shape == (1, h, w, 3) and out.dtype == np.uint8
        assert not np.array_equal(out[0], img)


def test_cartoon_reduces_colours(cartoon):
    img = gradient()
    out = run(cartoon, image=img[None])["image"][0]
    assert n_colours(out) < n_colours(img) / 4


def test_cartoon_draws_dark_edges_at_a_sharp_boundary(cartoon):
    img = scene()
    out = run(cartoon, image=img[None])["image"][0].astype(np.float32)
    luma = out @ np.array([0.299, 0.587, 0.114], np.float32)
    w = img.shape[1]
    edge = luma[4:-4, w // 2 - 2 : w // 2 + 2].min(axis=1)  # darkest pixel across the boundary
    left = luma[4:-4, 4 : w // 2 - 6].mean()
    right = luma[4:-4, w // 2 + 6 : -4].mean()
    assert (edge < 0.5 * min(left, right)).all()
    # Away from the boundary the noise is smoothed into flat colour: no spurious edges.
    assert luma[4:-4, 4 : w // 2 - 6].min() > 0.8 * left
    assert luma[4:-4, w // 2 + 6 : -4].min() > 0.8 * right


def test_cartoon_is_deterministic(cartoon):
    img = gradient()[None]
    assert np.array_equal(run(cartoon, image=img)["image"], run(cartoon, image=img)["image"])
    assert np.array_equal(run(cartoon, image=img)["image"], run(load_model("cartoon", "cpu"), image=img)["image"])


def test_cartoon_batched_equals_per_item(cartoon):
    imgs = np.stack([gradient(seed=s) for s in range(3)])
    batched = run(cartoon, image=imgs)["image"]
    single = np.concatenate([run(cartoon, image=imgs[i : i + 1])["image"] for i in range(3)])
    np.testing.assert_allclose(batched.astype(np.int16), single.astype(np.int16), atol=1)


# Ops with a direct ONNX counterpart (Conv, ConvTranspose, Pad edge-mode, Abs, Clip, Floor,
# Round, Cast, Transpose, ReduceSum and arithmetic) - what the TensorRT path will need.
EXPORTABLE = {"abs", "add", "clamp", "conv2d", "conv_transpose2d", "div", "floor", "mul", "pad", "permute",
              "round", "rsub", "sub", "sum", "to", "slice", "where", "cat", "avg_pool2d", "contiguous",
              "clone", "_assert_tensor_metadata"}


@pytest.mark.parametrize("shape", [(1, 37, 51, 3)])  # odd: includes the pad-and-crop path
def test_cartoon_filter_exports_to_one_graph_of_onnx_friendly_ops(shape):
    from gpu_worker.models import cartoon_filter

    net = cartoon_filter()
    img = torch.from_numpy(np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8))
    ep = torch.export.export(net, (img,))  # fails on graph breaks / data-dependent control flow
    ops = {str(n.target).split(".")[1] for n in ep.graph.nodes if n.op == "call_function"}
    assert ops <= EXPORTABLE, ops - EXPORTABLE
    with torch.inference_mode():
        assert torch.equal(ep.module()(img), net(img))


# ------------------------------------------------------------------------------ convnet


def test_convnet_outputs_logits_per_item(convnet):
    imgs = np.stack([gradient(64, 64, seed=s) for s in range(2)])
    out = run(convnet, image=imgs)["logits"]
    assert out.shape == (2, 1000) and out.dtype == np.float32
    assert np.isfinite(out).all() and out.std() > 0
    assert not np.allclose(out[0], out[1])


def test_convnet_batched_equals_per_item(convnet):
    imgs = np.stack([gradient(64, 96, seed=s) for s in range(3)])
    batched = run(convnet, image=imgs)["logits"]
    single = np.concatenate([run(convnet, image=imgs[i : i + 1])["logits"] for i in range(3)])
    np.testing.assert_allclose(batched, single, rtol=1e-4, atol=1e-4 * np.abs(single).max())


def test_convnet_is_deterministic_across_loads(convnet):
    torch.manual_seed(1234)  # the global RNG must not matter
    other = load_model("convnet", "cpu")
    for (n1, p1), (n2, p2) in zip(convnet.net.state_dict().items(), other.net.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    img = gradient(64, 64)[None]
    assert np.array_equal(run(convnet, image=img)["logits"], run(other, image=img)["logits"])


def test_image_models_reject_bad_inputs_with_a_clear_message(cartoon, convnet):
    from gpu_worker.models import InvalidInput

    with pytest.raises(InvalidInput, match="at least 32x32"):  # the request's 422, not a 500
        run(convnet, image=np.zeros((1, 16, 16, 3), np.uint8))
    for m in (cartoon, convnet):
        with pytest.raises(InvalidInput, match="uint8 HxWx3"):
            run(m, image=np.zeros((1, 40, 40, 3), np.float32))
        with pytest.raises(ValueError, match="uint8 HxWx3"):
            run(m, image=np.zeros((1, 40, 40), np.uint8))
        with pytest.raises(ValueError, match="named 'image'"):
            run(m, x=np.zeros((1, 40, 40, 3), np.uint8))


# ------------------------------------------------------------------------------ echo, chunks


def test_echo_returns_its_inputs_without_copying():
    m = load_model("echo", "cpu")
    x = np.arange(12, dtype=np.float32).reshape(1, 3, 4)
    out = m({"x": x, "y": x[:, 0]})
    assert out["x"] is x and np.shares_memory(out["y"], x)


@pytest.mark.parametrize("n,k", [(10, 4), (3, 4), (8, 1), (0, 3)])
def test_chunks_streams_in_order_and_concatenates_back(n, k):
    from gpu_worker.models import ChunksModel

    m = ChunksModel(k=k)
    assert m.streaming and not m.batchable
    x = np.arange(n * 2, dtype=np.int32).reshape(1, n, 2)
    parts = [p["x"] for p in m({"x": x})]
    assert len(parts) == max(1, min(k, n))
    assert all(len(p) or n == 0 for p in parts[0])
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), x)
    # Ordered: each partial continues where the previous one stopped.
    flat = [int(v) for p in parts for v in p[0, :, 0]]
    assert flat == sorted(flat)


def test_chunks_with_scalar_items():
    from gpu_worker.models import ChunksModel

    parts = list(ChunksModel()({"x": np.array([7.0])}))
    assert len(parts) == 1 and parts[0]["x"].tolist() == [7.0]


# ------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("name", sorted(SHIPPED_MODELS))
def test_load_each_shipped_model(name):
    m = load_model(name, "cpu")
    assert isinstance(m, Model)
    assert m.name == name and m.device == "cpu"
    ex = m.example_inputs()
    assert ex and all(isinstance(v, np.ndarray) for v in ex.values())
    assert m.cost(ex) > 0


FACTORIES = textwrap.dedent(
    '''
    import numpy as np
    import torch
    from gpu_worker.models import ModelBase

    class Doubler(ModelBase):
        name = "doubler"
        framework = "numpy"
        def __init__(self, device="cpu"):
            self.device = device
        def __call__(self, batch):
            return {"y": batch["x"] * 2}
        def example_inputs(self):
            return {"x": np.ones(3, np.float32)}

    def make_model(device):
        return Doubler(device)

    class Affine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(3.0))
        def forward(self, x):
            return x * self.scale + 1

    def make_module():          # no device parameter: called as make_module()
        return Affine()

    class DictNet(torch.nn.Module):
        batchable = False
        def forward(self, inputs):
            return {"sum": inputs["a"] + inputs["b"]}

    def make_dictnet(**kwargs):  # **kwargs: gets device=
        assert "device" in kwargs
        return DictNet()

    def make_callable(device="cpu"):
        def negate(batch):
            return {"neg": -batch["x"]}
        negate.example_inputs = lambda: {"x": np.zeros(2)}
        return negate

    class Holder:
        @staticmethod
        def factory():
            return lambda batch: {"z": batch["x"]}

    not_callable = 42

    def broken(device="cpu"):
        raise RuntimeError("weights missing")

    def returns_none():
        return None

    def make_seq():             # a stock nn.Sequential: forward(self, input)
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 2))

    class StarArgs(torch.nn.Module):
        def forward(self, *args):
            return args[0] * 2

    def build():
        return StarArgs()

    class Named(torch.nn.Module):
        name = "resnet-ish"
        def forward(self, x):
            return x

    def make_named():
        return Named()

    class OneDict(torch.nn.Module):
        def forward(self, inputs: dict):   # annotated: gets the dict even for one input
            return {"y": inputs["x"] + 1}

    def make_onedict():
        return OneDict()

    def make_lambda():
        return lambda batch: {"z": batch["x"]}

    class BadWarmup(torch.nn.Module):
        inputs = {"x": ("<f4", (4,))}
        example_inputs = {"x": np.ones(3, np.float32)}   # does not fit the Linear(4, 2)
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)
        def forward(self, x):
            return self.fc(x)

    def make_bad_warmup():
        return BadWarmup()

    def make_the_class():
        return Doubler

    def make_scripted():        # TorchScript: requires_grad_ is "not supported on ScriptModules"
        return torch.jit.script(Affine())

    def make_traced():          # traced: class TopLevelTracedModule, forward a ScriptMethod
        return torch.jit.trace(Affine(), torch.zeros(1, 2))

    def make_traced_seq():      # forward(self, input): one input binds whatever its name
        torch.manual_seed(0)
        return torch.jit.trace(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.zeros(1, 4))

    class NoMove(torch.nn.Module):
        def forward(self, x):
            return x
        def to(self, *args, **kwargs):
            raise RuntimeError("this module stays where it is")

    def make_nomove():
        return NoMove()

    from typing import Dict

    def negate_t(x: torch.Tensor) -> torch.Tensor:
        return -x

    def add_t(a: torch.Tensor, b: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"sum": a + b}

    def double_all(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {k + "2": v * 2 for k, v in batch.items()}

    def make_scripted_fn():     # a TorchScript function (ScriptFunction), not a module
        return torch.jit.script(negate_t)

    def make_scripted_two():
        fn = torch.jit.script(add_t)
        fn.batchable = False
        return fn

    def make_scripted_dict():
        return torch.jit.script(double_all)

    def make_traced_fn():       # traced: a ScriptFunction too, named after the function
        def shift(x, y):
            return x + y
        return torch.jit.trace(shift, (torch.zeros(1, 2), torch.zeros(1, 2)))

    class Mix(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            with torch.no_grad():
                self.lin.weight.fill_(1.0)
                self.lin.bias.fill_(0.5)
        def forward(self, x, y):
            return {"s": self.lin(x) + y}

    _B = torch.export.Dim("batch")

    def make_exported():        # torch.export, dynamic batch: batched, named after the factory
        return torch.export.export(Mix().eval(), (torch.ones(2, 3), torch.zeros(2, 2)),
                                   dynamic_shapes={"x": {0: _B}, "y": {0: _B}})

    def make_exported_kw():     # y passed as a keyword at the export: called so
        return torch.export.export(Mix().eval(), (torch.ones(2, 3),), {"y": torch.zeros(2, 2)},
                                   dynamic_shapes={"x": {0: _B}, "y": {0: _B}})

    def make_exported_one():    # a fixed batch of 1: each request alone
        program = torch.export.export(Mix().eval(), (torch.ones(1, 3), torch.zeros(1, 2)))
        program.name = "mix_one"
        return program

    def make_exported_two():    # a fixed batch of 2: no batch the worker makes passes its guards
        return torch.export.export(Mix().eval(), (torch.ones(2, 3), torch.zeros(2, 2)))

    class Scaled(torch.nn.Module):
        def forward(self, x, scale: float):
            return x * scale

    def make_exported_scalar():  # a Python scalar argument: no request can carry it
        return torch.export.export(Scaled(), (torch.ones(2, 3), 2.0),
                                   dynamic_shapes={"x": {0: _B}, "scale": None})
    '''
)


# Declarations a worker must refuse at load (no torch: a subprocess starts fast).
PLAIN = textwrap.dedent(
    r'''
    import numpy as np

    def nonsense_inputs():
        f = lambda batch: dict(batch)
        f.inputs = {"x": "nonsense"}
        return f

    def bad_dtype_outputs():
        f = lambda batch: dict(batch)
        f.outputs = {"y": ("float99", (3,))}
        return f

    def negative_size():
        f = lambda batch: dict(batch)
        f.inputs = {"x": ("<f4", (None, -3))}
        return f

    def not_a_dict():
        f = lambda batch: dict(batch)
        f.inputs = [("x", "<f4", (3,))]
        return f

    def spaced_name():
        f = lambda batch: dict(batch)
        f.name = "my model"
        return f

    def control_name():
        f = lambda batch: dict(batch)
        f.name = "echo\x07"
        return f

    def exits_quietly():
        raise SystemExit(0)

    def exits_saying():
        import sys
        sys.exit("no weights here")

    class Nameless:
        @property
        def name(self):
            raise RuntimeError("no name yet")
        def __call__(self, batch):
            return dict(batch)

    def nameless():
        return Nameless()

    def picky():                # a plain function that returns a list, not a dict
        def picky(batch):
            return [batch["x"]]
        return picky

    def declared():
        f = lambda batch: {"y": batch["x"] * 2}
        f.inputs = {"x": ("<f4", (None, 3))}
        f.outputs = {"y": (np.float32, [None, 3])}
        f.example_inputs = lambda: {"x": np.ones((2, 3), np.float32)}
        return f
    '''
)


@pytest.fixture
def factories(tmp_path, monkeypatch):
    pkg = tmp_path / "mymodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "zoo.py").write_text(FACTORIES)
    (pkg / "plain.py").write_text(PLAIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mymodels.zoo"
    for mod in ("mymodels.zoo", "mymodels.plain", "mymodels"):
        sys.modules.pop(mod, None)


def test_load_factory_returning_a_model(factories):
    m = load_model(f"{factories}:make_model", "cpu")
    assert type(m).__name__ == "Doubler" and m.name == "doubler"
    assert m({"x": np.ones((1, 3))})["y"].tolist() == [[2, 2, 2]]


def test_a_factory_that_returns_a_class_is_refused_at_load(factories):
    """A class has every attribute a Model has: it passed for one, and each call made an
    instance of it (the models audit)."""
    from gpu_worker.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="returned the class Doubler, not an instance of it: return Doubler"):
        load_model(f"{factories}:make_the_class", "cpu")


def test_load_factory_returning_an_nn_module(factories):
    m = load_model(f"{factories}:make_module", "cpu")
    assert isinstance(m, TorchModuleModel) and m.framework == "torch" and m.batchable
    assert m.name == "affine"  # the model's name (class name, lowercased), not the factory's
    assert not m.module.training and not any(p.requires_grad for p in m.module.parameters())
    out = run(m, x=np.array([[1.0, 2.0]], np.float32))
    assert list(out) == ["output"] and out["output"].tolist() == [[4.0, 7.0]]
    with pytest.raises(NotImplementedError):
        m.example_inputs()


@pytest.mark.parametrize("factory, name", [("make_scripted", "affine"), ("make_traced", "affine")])
def test_a_torchscript_module_is_a_module_model(factories, factory, name):
    """docs/models.md, "TorchScript": a scripted or traced module is wrapped as any
    nn.Module.  `requires_grad_` refused a scripted one at load, as a traceback (the models
    audit), and a traced one was named "topleveltracedmodule"."""
    m = load_model(f"{factories}:{factory}", "cpu")
    assert isinstance(m, TorchModuleModel) and m.name == name
    assert not m.module.training and not any(p.requires_grad for p in m.module.parameters())
    out = run(m, x=np.array([[1.0, 2.0]], np.float32))
    assert list(out) == ["output"] and out["output"].tolist() == [[4.0, 7.0]]


def test_a_torch_export_program_is_a_torch_model(factories):
    """docs/models.md, "torch.export": an `ExportedProgram` (TorchScript's successor: torch
    2.13 deprecates torch.jit) is run as the module it makes, called as it was exported.
    Callable, it was wrapped as a numpy callable, and every request failed ("Unable to call
    ExportedProgram directly")."""
    from gpu_worker.backends import make_backend
    from gpu_worker.models import InvalidInput, ModelLoadError, TorchExportedModel

    x, y = np.ones(3, np.float32), np.full(2, 2.0, np.float32)
    for factory in ("make_exported", "make_exported_kw"):
        m = load_model(f"{factories}:{factory}", "cpu")
        assert isinstance(m, TorchExportedModel) and m.framework == "torch" and m.batchable
        assert m.name == factory
        assert {k: v.shape for k, v in m.example_inputs().items()} == {"x": (3,), "y": (2,)}  # its own, item 0
        backend = make_backend(m, "cpu")
        for n in (1, 3):  # a lone request, and a batch of three
            outs = backend.run([{"x": x * i, "y": y} for i in range(1, n + 1)])
            assert [o["s"].tolist() for o in outs] == [[3.0 * i + 2.5] * 2 for i in range(1, n + 1)]
        with pytest.raises(InvalidInput, match="has none named 'y'"):
            m({"x": np.ones((1, 3), np.float32)})
        with pytest.raises(InvalidInput, match="does not take these inputs .Guard failed"):  # 422, not 500
            backend.run([{"x": np.ones(4, np.float32), "y": y}])

    one = load_model(f"{factories}:make_exported_one", "cpu")
    assert one.name == "mix_one" and one.batchable is False  # its fixed batch of 1: run alone
    assert make_backend(one, "cpu").run([{"x": x, "y": y}])[0]["s"].tolist() == [5.5, 5.5]
    with pytest.raises(ModelLoadError, match="fixes dimension 0 of its input.s. x, y .size 2, size 2.*Dim"):
        load_model(f"{factories}:make_exported_two", "cpu")
    with pytest.raises(ModelLoadError, match="takes 'scale', not a tensor"):
        load_model(f"{factories}:make_exported_scalar", "cpu")


def test_a_torchscript_function_is_a_torch_model(factories):
    """docs/models.md, "TorchScript": a scripted function (`torch.jit.script(fn)`) is served
    as a torch model, tensors in and out, its parameters bound as a module's forward's.  It
    was wrapped as a numpy callable and called with the dict of arrays: every request failed
    "Expected a value of type 'Tensor' for argument 'x' but instead found type 'dict'"."""
    from gpu_worker.backends import make_backend
    from gpu_worker.models import TorchFunctionModel

    m = load_model(f"{factories}:make_scripted_fn", "cpu")
    assert isinstance(m, TorchFunctionModel) and m.framework == "torch" and m.name == "negate_t"
    x = np.array([[1.0, -2.0]], np.float32)
    np.testing.assert_array_equal(run(m, x=x)["output"], -x)
    np.testing.assert_array_equal(run(m, image=x)["output"], -x)  # one tensor: positionally, whatever its name
    backend = make_backend(m, "cpu")
    outs = backend.run([{"x": x[0]}, {"x": x[0] * 3}])  # a batch of two through the torch backend
    np.testing.assert_array_equal(outs[1]["output"], -x[0] * 3)
    with pytest.raises(NotImplementedError):
        m.example_inputs()

    two = load_model(f"{factories}:make_scripted_two", "cpu")  # by name, and its own attributes honoured
    assert two.name == "add_t" and two.batchable is False
    a, b = np.ones((1, 2), np.float32), np.full((1, 2), 2.0, np.float32)
    assert run(two, a=a, b=b)["sum"].tolist() == [[3.0, 3.0]]

    d = load_model(f"{factories}:make_scripted_dict", "cpu")  # Dict[str, Tensor]: the dict, even of one
    assert run(d, x=a)["x2"].tolist() == [[2.0, 2.0]]

    traced = load_model(f"{factories}:make_traced_fn", "cpu")
    assert isinstance(traced, TorchFunctionModel) and traced.name == "shift"
    assert run(traced, x=a, y=b)["output"].tolist() == [[3.0, 3.0]]


def test_a_traced_modules_lone_input_binds_whatever_its_name(factories):
    # A traced forward has no signature that inspect reads: the input went by keyword
    # ("forward() is missing value for argument 'input'").  Its schema gives the names.
    m = load_model(f"{factories}:make_traced_seq", "cpu")
    assert m.name == "sequential"
    x = np.ones((3, 4), np.float32)
    with torch.inference_mode():
        want = m.module(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(run(m, image=x)["output"], want)
    np.testing.assert_array_equal(run(m, input=x)["output"], want)


@pytest.mark.parametrize("factory, words", [
    ("mymodels.zoo:make_nomove", "returned a NoMove that cannot be used as a model: RuntimeError: this module stays"),
    ("mymodels.plain:nameless", "returned a Nameless that cannot be used as a model: RuntimeError: no name yet"),
])
def test_what_wrapping_the_factorys_result_raises_is_a_model_load_error(factories, factory, words):
    # It escaped load_model as the bare exception: a traceback and exit 1 from the CLI.
    with pytest.raises(ModelLoadError, match=re.escape(words)):
        load_model(factory, "cpu")


def test_a_model_returning_no_dict_is_the_models_mistake(factories):
    # A plain TypeError, which the worker answered as what the model raised, "retrying may
    # help"; the same request fails the same way.
    from gpu_worker.backends import BadOutputs, make_backend

    m = load_model("mymodels.plain:picky", "cpu")
    with pytest.raises(BadOutputs, match="'picky' returned list; expected a dict of arrays/tensors"):
        make_backend(m, "cpu").run([{"x": np.zeros(2, np.float32)}])


def test_load_nn_module_taking_a_dict(factories):
    m = load_model(f"{factories}:make_dictnet", "cpu")
    assert not m.batchable
    out = run(m, a=np.array([[1.0]], np.float32), b=np.array([[2.0]], np.float32))
    assert out["sum"].tolist() == [[3.0]]


def test_load_factory_returning_a_callable(factories):
    m = load_model(f"{factories}:make_callable", "cpu")
    assert isinstance(m, CallableModel) and m.framework == "numpy"
    assert m({"x": np.array([[1.0]])})["neg"].tolist() == [[-1.0]]
    assert m.example_inputs()["x"].shape == (2,)
    assert m.cost({"x": np.zeros(4, np.float64)}) == 32.0


def test_load_dotted_factory_path(factories):
    m = load_model(f"{factories}:Holder.factory", "cpu")
    assert m({"x": np.ones(1)})["z"].tolist() == [1.0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown model 'nope'"),
        ("", "empty model spec"),
        ("mymodels.zoo:", "malformed"),
        (":factory", "malformed"),
        ("mymodels.missing:f", "cannot import 'mymodels.missing'"),
        ("mymodels.zoo:nothing", "has no attribute 'nothing'"),
        ("mymodels.zoo:not_callable", "not a callable factory"),
        ("mymodels.zoo:broken", "raised RuntimeError: weights missing"),
        ("mymodels.zoo:returns_none", "returned NoneType"),
    ],
)
def test_bad_spec_raises_model_load_error(factories, spec, message):
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(spec, "cpu")
    if "unknown" in message or "malformed" in message or "returned" in message:
        assert "package.module:factory" in str(info.value)  # says what was expected


@pytest.mark.parametrize("factory, message", [
    ("nonsense_inputs", "declares `inputs['x']` = 'nonsense', not a (dtype, shape) pair"),
    ("bad_dtype_outputs", "declares `outputs['y']` = ('float99', (3,)): 'float99' is not a numpy dtype"),
    ("negative_size", "sizes must be integers >= 0 or None"),
    ("not_a_dict", "`inputs` is a list, not a dict"),
    ("spaced_name", "the model name 'my model' has whitespace or control characters"),
    ("control_name", "has whitespace or control characters"),
])
def test_malformed_declarations_and_names_are_refused_at_load(factories, factory, message):
    with pytest.raises(ModelLoadError, match=re.escape(message)) as info:
        load_model(f"mymodels.plain:{factory}", "cpu")
    text = str(info.value)
    assert "\n" not in text
    if factory not in ("spaced_name", "control_name"):
        assert "(dtype, shape)" in text and "docs/models.md" in text  # what to write instead


def test_declared_outputs_are_kept_and_parsed(factories):
    from gpu_worker.signature import parse_inputs

    m = load_model("mymodels.plain:declared", "cpu")
    assert parse_inputs(m.outputs, "outputs") == {"y": ("<f4", (None, 3))}
    assert parse_inputs(m.inputs) == {"x": ("<f4", (None, 3))}


# ------------------------------------------------- single-input modules and default names


def test_nn_sequential_binds_a_lone_input_whatever_its_name(factories):
    from gpu_worker.backends import make_backend, warmup

    m = load_model(f"{factories}:make_seq", "cpu")
    assert isinstance(m, TorchModuleModel) and m.name == "sequential"
    lin = m.module[0]
    x = np.array([[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.0, 2.0]], np.float32)
    want = (torch.from_numpy(x) @ lin.weight.T + lin.bias).numpy()
    out = run(m, x=x)  # the model's own call, as in the tests above
    assert list(out) == ["output"] and np.allclose(out["output"], want)
    # The worker's path: a backend run per request, and a warm-up on example inputs.
    backend = make_backend(m, "cpu")
    outs = backend.run([{"x": x[0]}, {"x": x[1]}])
    assert np.allclose(np.stack([o["output"] for o in outs]), want)
    assert np.allclose(backend.run([{"input": x[0]}])[0]["output"], want[0])  # any name
    m.module.example_inputs = {"x": x[0]}
    assert set(warmup(backend, m, [1, 2])) == {1, 2}


def test_star_args_forward_binds_a_lone_input(factories):
    m = load_model(f"{factories}:build", "cpu")
    assert m.name == "starargs"  # not "build"
    assert run(m, image=np.ones((1, 2), np.float32))["output"].tolist() == [[2.0, 2.0]]


def test_a_forward_annotated_as_dict_still_gets_the_dict(factories):
    m = load_model(f"{factories}:make_onedict", "cpu")
    assert run(m, x=np.zeros((1, 2), np.float32))["y"].tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("factory, name", [
    ("make_module", "affine"),        # nn.Module: class name, lowercased
    ("make_named", "resnet-ish"),     # its own name attribute
    ("make_model", "doubler"),        # a Model: its name
    ("make_callable", "negate"),      # a named function
    ("make_lambda", "make_lambda"),   # anonymous: only then the factory's name
])
def test_the_default_service_name_is_the_models(factories, factory, name):
    assert load_model(f"{factories}:{factory}", "cpu").name == name


def test_the_worker_registers_the_models_name(factories):
    from gpu_worker.worker import Worker, WorkerConfig

    class Upstream:  # never connected: only the name the worker would register matters
        def close(self, *a, **k):
            pass

    w = Worker(WorkerConfig(broker="ipc:///nonexistent", model=f"{factories}:make_module", device="cpu",
                            warmup=False, out_capacity=1 << 20), upstream=Upstream())
    with w:
        assert w.service == "affine"


# ------------------------------------------------- load failures: one line, exit non-zero


def _start_worker(model: str, pythonpath: str, *extra: str):
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "gpu_worker", "--model", model, "--device", "cpu",
                           "--broker", "ipc:///tmp/zmq-infer-test-no-broker", "--out-capacity-mb", "1", *extra],
                          capture_output=True, text=True, timeout=60, env=env)


def _one_line(proc) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_model_that_does_not_import_is_one_line(factories, tmp_path):
    line = _one_line(_start_worker("mymodels.missing:make", str(tmp_path)))
    assert "cannot import 'mymodels.missing'" in line and "PYTHONPATH" in line


def test_a_factory_that_raises_is_one_line(factories, tmp_path):
    line = _one_line(_start_worker(f"{factories}:broken", str(tmp_path)))
    assert "weights missing" in line and "fix the factory" in line


@pytest.mark.parametrize("factory, words", [("exits_quietly", "raised SystemExit: 0"),
                                            ("exits_saying", "raised SystemExit: no weights here")])
def test_a_factory_that_exits_is_one_line_and_exit_2(factories, tmp_path, factory, words):
    # sys.exit(0) in a factory ended the worker silently with status 0, which a launcher
    # takes for a clean leave; sys.exit("...") with 1.
    p = _start_worker(f"mymodels.plain:{factory}", str(tmp_path))
    line = _one_line(p)
    assert p.returncode == 2 and words in line and "fix the factory" in line, line


def test_a_model_whose_warmup_raises_is_one_line(factories, tmp_path):
    line = _one_line(_start_worker(f"{factories}:make_bad_warmup", str(tmp_path)))
    assert "warm-up" in line and "example_inputs" in line and "--no-warmup" in line


@pytest.mark.parametrize("model, extra, words", [
    ("mymodels.plain:nonsense_inputs", (), ("`inputs['x']` = 'nonsense'", "(dtype, shape)")),
    ("mymodels.plain:spaced_name", (), ("'my model'", "whitespace", "change the model's `name`")),
    ("echo", ("--max-batch", "0"), ("max_batch (--max-batch) must be an integer from 1 to 65536, not 0",)),
    # what the broker would refuse in the READY (it was refused forever, the worker "ready")
    ("echo", ("--credit", "70000"), ("credit (--credit) must be an integer from 1 to 65536", "70000")),
    ("echo", ("--service", "mmi.x"), ("--service", "'mmi.x'", "starts with 'mmi.'")),
    ("echo", ("--heartbeat-interval", "0"), ("--heartbeat-interval", "from 0.001 to 3600")),
    # a 1 ms liveness window: the worker reconnected hundreds of times a second
    ("echo", ("--heartbeat-interval", "0.01", "--heartbeat-liveness", "3"),
     ("--heartbeat-interval x --heartbeat-liveness", "must be at least 0.1 s, not 0.01 x 3")),
    ("echo", ("--heartbeat-liveness", "1"), ("--heartbeat-liveness", "an integer from 2 to 1000")),
    ("echo", ("--transports", "carrier-pigeon"), ("--transports", "carrier-pigeon")),
    ("echo", ("--device", "cpu", "--transports", "inline,shm,cuda"), ("--transports", "needs a CUDA device", "cpu")),
    ("echo", ("--service", "two words"), ("--service", "'two words'", "whitespace")),
    # a backend that cannot run the model (BackendError while it is built): what to pass instead
    ("cartoon", ("--backend", "numpy", "--no-warmup"),
     ("backend 'numpy' cannot run model 'cartoon'", "is a torch model", "use --backend auto")),
])
def test_bad_declarations_and_options_are_one_line_and_exit_2(factories, tmp_path, model, extra, words):
    proc = _start_worker(model, str(tmp_path), *extra)
    line = _one_line(proc)
    assert proc.returncode == 2, proc.stderr
    for w in words:
        assert w in line, line
    assert "make_backend" not in line  # the library's advice means nothing on the command line


def test_a_size_in_mib_below_one_names_what_was_typed(factories, tmp_path):
    """It named the bytes the MiB became (-1048576), not the -1 typed."""
    proc = _start_worker("echo", str(tmp_path), "--out-capacity-mb", "-1")
    assert proc.returncode == 2
    assert "argument --out-capacity-mb: expected a whole number of MiB >= 1, not '-1'" in proc.stderr, proc.stderr


def test_a_credit_below_max_batch_caps_the_batch(tmp_path, caplog):
    """The broker never hands a worker more than its credit at once: a batch of more could
    never fill, and under a backlog each would wait out max_delay for company that cannot
    come.  The batch size is capped at the credit, with a WARNING."""
    from gpu_worker.worker import Worker, WorkerConfig

    with caplog.at_level(logging.WARNING, logger="gpu_worker"):
        w = Worker(WorkerConfig(broker=f"ipc://{tmp_path}/none.ipc", model="echo", warmup=False, max_batch=8,
                                credit=3))
    try:
        assert (w.credit, w.batcher.max_batch, w.max_batch) == (3, 3, 3)
        assert any("--credit 3 is below --max-batch 8" in r.getMessage() for r in caplog.records)
    finally:
        w.close()


def test_cuda_transports_with_an_auto_device_on_a_cpu_host_are_left_out(tmp_path, caplog):
    """One pool's flags for hosts with and without a GPU: --device auto with cuda among the
    transports starts on the CPU host without cuda (and says so); --device cpu refuses it."""
    from gpu_worker.devices import resolve_device
    from gpu_worker.worker import Worker, WorkerConfig

    if resolve_device("auto") != "cpu":
        pytest.skip("a CUDA device is here: auto chooses it")
    with caplog.at_level(logging.WARNING, logger="gpu_worker"):
        w = Worker(WorkerConfig(broker=f"ipc://{tmp_path}/none.ipc", model="echo", warmup=False, device="auto",
                                transports=("inline", "shm", "cuda")))
    try:
        assert w.device == "cpu" and "cuda" not in w.transports and w.cfg.transports == ("inline", "shm")
        assert any("no CUDA device is here" in r.getMessage() for r in caplog.records)
    finally:
        w.close()


def test_tensorrt_export_failures_are_backend_errors(factories, tmp_path, monkeypatch):
    """What TrtBackend meets before the first TensorRT call (without onnx or a GPU here): a
    model without example inputs, or one that raises on them, is a BackendError saying so,
    not the raw NotImplementedError or the model's own exception."""
    from gpu_worker import trt
    from gpu_worker.backends import BackendError

    monkeypatch.setattr(trt, "onnx_available", lambda: (True, "ok"))  # both fail before the exporter runs
    with pytest.raises(BackendError, match=r"'affine' has no example_inputs\(\); TensorRT needs them"):
        trt.export_onnx(load_model(f"{factories}:make_module", "cpu"), tmp_path / "m.onnx")
    with pytest.raises(BackendError, match="raised on its example inputs while being exported") as info:
        trt.export_onnx(load_model(f"{factories}:make_bad_warmup", "cpu"), tmp_path / "m.onnx")
    assert "RuntimeError" in str(info.value) and isinstance(info.value.__cause__, RuntimeError)


def test_a_tensorrt_build_failure_is_one_line_and_exit_2(factories, tmp_path, monkeypatch, capsys):
    """`--backend tensorrt` for a model without example inputs: on a GPU, TrtBackend raises
    the BackendError of `trt.export_onnx` above while the worker builds its backend; here
    make_backend raises that same error in its place."""
    from gpu_worker import backends, trt
    from gpu_worker.__main__ import main

    monkeypatch.setattr(trt, "onnx_available", lambda: (True, "ok"))

    def make_backend(model, device="cpu", kind="auto", **options):
        assert kind == "tensorrt"
        trt.export_onnx(model, tmp_path / "m.onnx")  # raises: the model has no example inputs
        raise AssertionError("export_onnx should have raised")

    monkeypatch.setattr(backends, "make_backend", make_backend)
    rc = main(["--broker", f"ipc://{tmp_path}/none.ipc", "--model", f"{factories}:make_module", "--device", "cpu",
               "--backend", "tensorrt", "--no-warmup", "--out-capacity-mb", "1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("python -m gpu_worker: backend 'tensorrt' cannot run model"), lines[0]
    assert "has no example_inputs()" in lines[0] and "give the model example_inputs()" in lines[0], lines[0]


def test_the_call_style_memo_is_bounded_whatever_names_clients_send(factories):
    """A torch model that declares no inputs takes any tensor names, and the worker remembers
    how each set of names binds to its forward (`TorchModuleModel._style`).  Names are the
    client's choice: a client naming its tensors per session or per frame (or a hostile one)
    made a worker that lives for weeks keep one entry per set of names ever sent (each up to
    a header's worth of names).  The memo is bounded; every call still binds right."""
    from gpu_worker.models import MAX_CALL_STYLES

    m = load_model(f"{factories}:make_seq", "cpu")
    x = np.ones((1, 4), np.float32)
    want = run(m, x=x)["output"]
    for i in range(MAX_CALL_STYLES * 4):
        assert np.allclose(run(m, **{f"frame_{i}": x})["output"], want)
        assert len(m._call_style) <= MAX_CALL_STYLES, f"{len(m._call_style)} entries after {i + 1} name sets"
    assert np.allclose(run(m, x=x)["output"], want)  # an entry made again after a reset binds as before
