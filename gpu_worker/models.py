"""Shipped models and ``--model`` loading.

A model sees one *batch*: a dict of name -> array with a leading batch axis (N >= 1); it
returns a dict of name -> array whose leading axis is that same N (or, when ``streaming``,
an iterator of such dicts).  A model with ``batchable = False`` is always called with N == 1.
Backends (``gpu_worker.backends``) do the stacking, conversion and splitting; models never
see requests, sockets or shared memory.

``framework`` says what the arrays are: "torch" models get ``torch.Tensor`` on ``device``,
"numpy" models get ``np.ndarray``.  Shipped models:

==========  =========  =========  ==========  ===============================================
name        framework  batchable  streaming   inputs -> outputs (per request)
==========  =========  =========  ==========  ===============================================
echo        numpy      yes        no          any -> the same arrays (no copy)
cartoon     torch      yes        no          image uint8 HxWx3 -> image uint8 HxWx3
convnet     torch      yes        no          image uint8 HxWx3 (H, W >= 32) -> logits f32 (1000,)
chunks      numpy      no         yes         x (any shape) -> k partials of x split on axis 0
==========  =========  =========  ==========  ===============================================

torch is imported only when a torch model is built, so ``echo`` and ``chunks`` load and run
on an install without torch.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "SHIPPED_MODELS",
    "CallableModel",
    "CartoonModel",
    "ChunksModel",
    "ConvNetModel",
    "EchoModel",
    "InvalidInput",
    "Model",
    "ModelBase",
    "ModelLoadError",
    "TorchExportedModel",
    "TorchFunctionModel",
    "TorchModuleModel",
    "cartoon_filter",
    "load_model",
    "name_problem",
    "normalise_outputs",
    "stream_outputs",
    "wants_mapping",
    "MAX_CALL_STYLES",
]


class ModelLoadError(Exception):
    """``load_model`` could not turn a spec into a Model; the message says what was expected."""


class InvalidInput(ValueError):
    """Raise it from a model for inputs it cannot take (an image too small, a value out of
    range): the request's fault, answered ``422 INVALID_INPUT`` with this message (the client
    raises ``client_sdk.InvalidInput``), where anything else a model raises is the model's
    (``500 INTERNAL``).  In a batch, as any exception, it fails only the requests that raise it
    when run alone (docs/models.md)."""


@runtime_checkable
class Model(Protocol):
    """What a worker needs from a model.

    ``framework`` ("torch" or "numpy") and ``device`` are optional on custom models: a
    missing ``framework`` means "torch", a missing ``device`` means the device it was loaded
    for.
    """

    name: str
    batchable: bool
    streaming: bool

    def cost(self, inputs: Mapping[str, np.ndarray]) -> float: ...

    def __call__(self, batch: Mapping[str, Any]) -> Any: ...

    def example_inputs(self) -> dict[str, np.ndarray]: ...


_MODEL_ATTRS = ("name", "batchable", "streaming", "cost", "example_inputs")


def _is_model(obj: object) -> bool:
    """Whether a factory's result is a Model, used as is: an object with every attribute of
    the interface.  A plain function, or an ``nn.Module`` called through ``nn.Module``'s own
    ``__call__`` (its ``forward``), is not one even when it carries all of them: those are
    the optional attributes docs/models.md lists for a wrapped module or function, which
    stays a numpy callable (`CallableModel`) or a module called with keyword arguments in
    eval mode on its device (`TorchModuleModel`); it was used as is (the model-docs hunt)."""
    if not callable(obj) or not all(hasattr(obj, a) for a in _MODEL_ATTRS):
        return False
    if isinstance(obj, ModelBase):
        return True
    if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isbuiltin(obj) or isinstance(obj, functools.partial):
        return False
    if _is_script_function(obj):  # a function too, TorchScript's: wrapped (`TorchFunctionModel`)
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        return type(obj).__call__ is not torch.nn.Module.__call__  # a module that overrides it takes the dict
    return True


def _nbytes(inputs: Mapping[str, Any]) -> float:
    return float(sum(getattr(a, "nbytes", 0) for a in inputs.values()))


class ModelBase:
    """Defaults for the optional parts of the Model interface."""

    name = "model"
    framework = "torch"
    batchable = True
    streaming = False
    device = "cpu"
    # Declared inputs, {name: (dtype str or None, shape with None for variable axes, or
    # None)}; None: not declared, anything goes (gpu_worker.signature checks requests).
    inputs: dict | None = None
    # Declared outputs, the same way: shown by the broker's /v2/models/{service}, not checked.
    outputs: dict | None = None

    def cost(self, inputs: Mapping[str, np.ndarray]) -> float:
        # Bytes are a fair default: copying and most elementwise work scale with them.
        return _nbytes(inputs)

    def example_inputs(self) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"model {self.name!r} has no example inputs")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} on {self.device}>"


# --------------------------------------------------------------------------- numpy models


class EchoModel(ModelBase):
    """Returns its inputs: measures the transport, not the model."""

    name = "echo"
    framework = "numpy"

    def __init__(self, device: str = "cpu"):
        self.device = device

    def __call__(self, batch):
        # The same objects, not copies: the backend's output views then alias the inputs.
        return dict(batch)

    def example_inputs(self):
        return {"x": np.arange(16, dtype=np.float32)}


class ChunksModel(ModelBase):
    """Streams its input ``x`` back as ``k`` consecutive pieces along the item's first axis.

    Concatenating the partials (on axis 0 of the per-request arrays) gives ``x`` back, which
    is what the PARTIAL-ordering tests check.
    """

    name = "chunks"
    framework = "numpy"
    batchable = False
    streaming = True

    def __init__(self, device: str = "cpu", k: int = 4):
        if k < 1:
            raise ValueError("k must be >= 1")
        self.device = device
        self.k = k

    def __call__(self, batch) -> Iterator[dict]:
        x = batch["x"]
        if x.ndim < 2:  # a per-request scalar cannot be split: one partial carries it
            yield {"x": x}
            return
        n = x.shape[1]
        pieces = max(1, min(self.k, n))  # never an empty partial unless x itself is empty
        for i in range(pieces):
            # Plain slicing works on numpy arrays and torch tensors alike.
            yield {"x": x[:, i * n // pieces : (i + 1) * n // pieces]}

    def example_inputs(self):
        return {"x": np.arange(32, dtype=np.float32)}


# --------------------------------------------------------------------------- torch models


@functools.cache
def _nets():
    """nn.Module classes, defined on first use so that importing this module never imports
    torch."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class CartoonFilter(nn.Module):
        """Cartoon look: edge-preserving smoothing, k-level colour quantisation, dark edges.

        uint8 NxHxWx3 in, uint8 NxHxWx3 out.  Only conv2d, conv_transpose2d, pad, abs, clamp,
        floor, round and elementwise arithmetic, so it exports to ONNX/TensorRT as is.

        The smoothing and the edge detector run at half resolution: that is most of the
        work, the look hardly changes, and it leaves a 720p frame at ~30-40 ms on one CPU
        core.  Both are brought back to full size with an exact 2x bilinear
        conv_transpose2d (cheaper on CPU than interpolate, and a plain ONNX op).
        """

        def __init__(self, levels: int = 8, passes: int = 3, sigma: float = 40.0,
                     edge_low: float = 80.0, edge_high: float = 200.0, edge_strength: float = 0.85):
            super().__init__()
            if not 2 <= levels <= 256:
                raise ValueError("levels must be in [2, 256]")
            self.levels = levels
            self.passes = passes
            self.sigma = sigma
            self.edge_low = edge_low
            self.edge_high = edge_high
            self.edge_strength = edge_strength
            b = torch.tensor([1.0, 2.0, 1.0])
            self.register_buffer("blur", (b[:, None] * b[None, :] / 16).expand(3, 1, 3, 3).contiguous())
            self.register_buffer("down", torch.full((3, 1, 2, 2), 0.25))
            u = torch.tensor([0.25, 0.75, 0.75, 0.25])
            up = u[:, None] * u[None, :]
            self.register_buffer("up3", up.expand(3, 1, 4, 4).contiguous())
            self.register_buffer("up1", up.view(1, 1, 4, 4).clone())
            gx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
            self.register_buffer("sobel", torch.stack([gx, gx.t()])[:, None].contiguous())
            self.register_buffer("luma", torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1))

        def _upsample2x(self, x, weight):
            # Replicate-pad one low-res pixel so the borders interpolate towards themselves
            # instead of towards zero; padding=3 then crops to exactly 2x the input size.
            x = F.pad(x, (1, 1, 1, 1), mode="replicate")
            return F.conv_transpose2d(x, weight, stride=2, padding=3, groups=weight.shape[0])

        def forward(self, image):
            # NHWC uint8 -> NCHW float without a transpose copy: the permuted view is
            # channels_last, which the CPU conv kernels prefer anyway.
            x = image.permute(0, 3, 1, 2).float()
            h, w = x.shape[-2], x.shape[-1]
            ph, pw = h % 2, w % 2
            if ph or pw:  # odd sizes: pad to even, crop at the end
                x = F.pad(x, (0, pw, 0, ph), mode="replicate")
            s = F.conv2d(x, self.down, stride=2, groups=3)  # 2x2 mean; much faster than avg_pool2d here
            for _ in range(self.passes):
                # Sigma-filter style step: move towards the local blur only where the pixel
                # is close to it, so strong edges stay put while flat areas lose noise.
                b = F.conv2d(F.pad(s, (1, 1, 1, 1), mode="replicate"), self.blur, groups=3)
                d = (b - s).abs().sum(1, keepdim=True)
                s = s + (1.0 - d / self.sigma).clamp(0.0, 1.0) * (b - s)
            lum = F.conv2d(s, self.luma)
            g = F.conv2d(F.pad(lum, (1, 1, 1, 1), mode="replicate"), self.sobel)
            mag = g.abs().sum(1, keepdim=True)
            # A ramp instead of a hard threshold gives anti-aliased lines after upsampling.
            e = ((mag - self.edge_low) / (self.edge_high - self.edge_low)).clamp(0.0, 1.0)
            s = self._upsample2x(s, self.up3)
            e = self._upsample2x(e, self.up1)
            step = 256.0 / self.levels
            q = (torch.floor(s / step) + 0.5) * step
            out = q * (1.0 - self.edge_strength * e)
            if ph or pw:
                out = out[:, :, :h, :w]
            out = out.round().clamp(0.0, 255.0).to(torch.uint8).permute(0, 2, 3, 1)
            return out.contiguous()

    class ConvNet(nn.Module):
        """An isotropic CNN (patchify stem, then 3x3 residual convs at 1/32 resolution, an MLP
        head).  Built so that batching pays off even on a CPU: at 7x7 spatial size with 512
        channels a single image makes a skinny matrix product that cannot use the cores
        well, and the head is a weight-bandwidth-bound matrix-vector product at batch 1;
        a batch reuses every weight N times.
        """

        def __init__(self, width: int = 512, patch: int = 32, depth: int = 6, hidden: int = 1024,
                     classes: int = 1000):
            super().__init__()
            self.patch = patch
            self.stem = nn.Conv2d(3, width, patch, stride=patch)
            self.blocks = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(depth))
            self.hidden = nn.Linear(width, hidden)
            self.head = nn.Linear(hidden, classes)

        def forward(self, image):
            x = image.permute(0, 3, 1, 2).float() * (2.0 / 255.0) - 1.0
            x = F.relu(self.stem(x))
            for conv in self.blocks:
                # Halving the residual branch keeps activations bounded without norm layers.
                x = F.relu(x + 0.5 * conv(x))
            x = x.mean(dim=(2, 3))
            return self.head(F.relu(self.hidden(x)))

    def seeded_init(module: nn.Module, seed: int) -> None:
        # A private CPU generator: the weights do not depend on (or disturb) the global RNG,
        # and they are the same whichever device the model is moved to afterwards.
        g = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                else:
                    fan_in = p[0].numel()
                    p.normal_(0.0, (2.0 / fan_in) ** 0.5, generator=g)

    return type("Nets", (), {"CartoonFilter": CartoonFilter, "ConvNet": ConvNet,
                             "seeded_init": staticmethod(seeded_init)})


def cartoon_filter(**params):
    """The bare ``nn.Module`` behind ``cartoon`` (for ONNX/TensorRT export)."""
    return _nets().CartoonFilter(**params).eval()


def _check_image(batch, model: str, min_side: int = 1):
    image = batch.get("image")
    if image is None:
        raise InvalidInput(f"{model} needs an input named 'image' (uint8 HxWx3), got {sorted(batch)}")
    if image.ndim != 4 or image.shape[-1] != 3 or not str(image.dtype).endswith("uint8"):
        shape = tuple(image.shape[1:])
        raise InvalidInput(f"{model} needs 'image' as uint8 HxWx3, got {image.dtype} {shape}")
    if image.shape[1] < min_side or image.shape[2] < min_side:
        raise InvalidInput(f"{model} needs images of at least {min_side}x{min_side}, got {tuple(image.shape[1:])}")
    return image


class _TorchNetModel(ModelBase):
    framework = "torch"

    def _prepare(self, net, device: str):
        net.eval().requires_grad_(False)
        self.net = net.to(device)
        self.device = device


class CartoonModel(_TorchNetModel):
    """The ``cartoon`` AR filter (see ``_nets().CartoonFilter``)."""

    name = "cartoon"
    inputs = {"image": ("|u1", (None, None, 3))}  # one RGB frame, any size
    outputs = {"image": ("|u1", (None, None, 3))}  # the same frame, cartooned

    def __init__(self, device: str = "cpu", **params):
        self._prepare(_nets().CartoonFilter(**params), device)

    def cost(self, inputs):
        image = inputs["image"]
        return float(image.shape[0] * image.shape[1])  # pixels: the filter is per-pixel work

    def __call__(self, batch):
        return {"image": self.net(_check_image(batch, "cartoon"))}

    def example_inputs(self):
        rng = np.random.default_rng(0)
        return {"image": rng.integers(0, 256, (720, 1280, 3), dtype=np.uint8)}


class ConvNetModel(_TorchNetModel):
    """The ``convnet`` compute-bound benchmark model, with weights from a fixed seed."""

    name = "convnet"
    inputs = {"image": ("|u1", (None, None, 3))}
    outputs = {"logits": ("<f4", (1000,))}

    def __init__(self, device: str = "cpu", seed: int = 0, **params):
        import torch

        nets = _nets()
        # Built on the meta device so the default init (thrown away anyway) costs nothing.
        with torch.device("meta"):
            net = nets.ConvNet(**params)
        net = net.to_empty(device="cpu")
        nets.seeded_init(net, seed)
        self._min_side = net.patch
        self._prepare(net, device)
        if device.startswith("cuda"):
            self.net = self.net.to(memory_format=torch.channels_last)

    def cost(self, inputs):
        image = inputs["image"]
        return float(image.shape[0] * image.shape[1])

    def __call__(self, batch):
        return {"logits": self.net(_check_image(batch, "convnet", self._min_side))}

    def example_inputs(self):
        rng = np.random.default_rng(0)
        return {"image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)}


# --------------------------------------------------------------------------- adapters


def _attr_or(obj, name, default):
    value = getattr(obj, name, default)
    return default if value is None else value


def _binds_one_positional(sig: inspect.Signature) -> bool:
    """Whether ``forward`` can be called with exactly one positional argument."""
    try:
        sig.bind(None)
    except TypeError:
        return False
    return True


_MAPPING_ANNOTATIONS = ("dict", "Dict", "Mapping", "MutableMapping")


def wants_mapping(sig: inspect.Signature) -> bool:
    """Whether the first positional parameter is annotated as a dict (it then gets the batch
    dict even when the batch has one tensor)."""
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL):
            ann = p.annotation
            if ann is p.empty:
                return False
            if not isinstance(ann, str):
                origin = getattr(ann, "__origin__", None) or ann
                if isinstance(origin, type) and issubclass(origin, Mapping):
                    return True
                ann = getattr(origin, "__name__", str(origin))
            base = ann.split("[", 1)[0].rsplit(".", 1)[-1].strip()
            return base in _MAPPING_ANNOTATIONS
    return False


def _forward_signature(module) -> inspect.Signature | None:
    """The signature of ``module.forward``, or None if it has none to read.  A traced
    TorchScript module's forward (a ``ScriptMethod``) has none that `inspect` reads (a
    scripted one has): it is made from the method's schema, whose first argument is
    ``self``, so that its inputs bind by name or positionally as a module's do."""
    forward = module.forward
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        pass
    return _schema_signature(forward, method=True)


def _schema_signature(fn, *, method: bool) -> inspect.Signature | None:
    """The signature of a TorchScript method or function (``ScriptMethod``,
    ``ScriptFunction``: `inspect` reads none), made from its schema; a method's first
    argument, ``self``, is left out.  None if there is no schema, or one that Python's
    signatures cannot say.  Each parameter is annotated with its TorchScript type's name
    (``Dict[str, Tensor]``), so that `wants_mapping` reads a dict parameter as one."""
    args = list(getattr(getattr(fn, "schema", None), "arguments", None) or ())
    if method:
        if not args or args[0].name != "self":
            return None
        args = args[1:]
    P = inspect.Parameter
    try:
        return inspect.Signature([P(a.name, P.KEYWORD_ONLY if a.kwarg_only else P.POSITIONAL_OR_KEYWORD,
                                    default=a.default_value if a.has_default_value() else P.empty,
                                    annotation=str(a.type))
                                  for a in args])
    except (TypeError, ValueError):  # a schema Python's signatures cannot say
        return None


#: sets of input names whose binding to a forward a torch model remembers (`_TorchCallModel._style`)
MAX_CALL_STYLES = 64


class _TorchCallModel(ModelBase):
    """What `TorchModuleModel` and `TorchFunctionModel` share: torch tensors in and out, the
    batch bound to the wrapped callable's parameters by name (else as `TorchModuleModel`
    says), and the optional attributes read from the wrapped object."""

    framework = "torch"

    def _wrap(self, target, signature: inspect.Signature | None, *, name: str, device: str) -> None:
        self._target = target
        self.name = name
        self.device = device
        self.batchable = bool(_attr_or(target, "batchable", True))
        self.streaming = bool(_attr_or(target, "streaming", False))
        self.inputs = _attr_or(target, "inputs", None)
        self.outputs = _attr_or(target, "outputs", None)
        self._call_style: dict[tuple[str, ...], str] = {}
        self._signature = signature

    def _style(self, names: tuple[str, ...]) -> str:
        style = self._call_style.get(names)
        if style is None:
            style = "kwargs"
            sig = self._signature
            if sig is not None:
                try:
                    sig.bind(**dict.fromkeys(names))
                except TypeError:
                    style = "dict"
                    if len(names) == 1 and _binds_one_positional(sig) and not wants_mapping(sig):
                        style = "positional"
            memo = self._call_style
            if len(memo) >= MAX_CALL_STYLES:
                # Names are the client's choice (a model that declares no inputs takes any):
                # bounded, so that names per session or per frame cannot grow a worker that
                # lives for weeks.  The sets in use are remembered again at their next call.
                memo.clear()
            memo[names] = style
        return style

    def __call__(self, batch):
        names = tuple(sorted(batch))
        style = self._style(names)
        if style == "kwargs":
            out = self._target(**batch)
        elif style == "positional":
            (tensor,) = batch.values()
            out = self._target(tensor)
        else:
            out = self._target(dict(batch))
        if self.streaming:
            return stream_outputs(out, self.name)
        return normalise_outputs(out, self.name)

    def cost(self, inputs):
        fn = getattr(self._target, "cost", None)
        return float(fn(inputs)) if callable(fn) else _nbytes(inputs)

    def example_inputs(self):
        ex = getattr(self._target, "example_inputs", None)
        if ex is None:
            return super().example_inputs()
        return dict(ex() if callable(ex) else ex)


class TorchModuleModel(_TorchCallModel):
    """Wraps an ``nn.Module`` returned by a ``package.module:factory`` (a TorchScript module,
    scripted, traced or loaded, included).

    The module is called with the batch as keyword arguments (``forward(self, image)`` for
    an input named "image").  When the names do not bind: a batch of one tensor goes to a
    forward that takes one positional argument (``nn.Sequential``'s ``forward(self, input)``,
    ``forward(self, *args)``) positionally, whatever its name -- unless that parameter is
    annotated as a dict/Mapping, which gets the dict; a batch of several tensors goes to a
    single-parameter forward as the whole dict.  A returned tensor becomes the output
    "output"; a returned dict is used as is.  Optional attributes on the module override
    the defaults: ``batchable``, ``streaming``, ``cost(inputs)``, ``example_inputs`` (a dict
    or a function returning one).
    """

    def __init__(self, module, *, name: str, device: str = "cpu"):
        module.eval()
        # Gradients off one parameter at a time, which is all `requires_grad_(False)` does: a
        # TorchScript module (torch.jit.script) refuses that call ("not supported on
        # ScriptModules"), and was refused at load (the models audit).  The backend runs
        # every model under inference mode anyway.
        for p in module.parameters():
            p.requires_grad_(False)
        self.module = module.to(device)
        self._wrap(self.module, _forward_signature(module), name=name, device=device)


class TorchFunctionModel(_TorchCallModel):
    """Wraps a TorchScript function (``torch.jit.script(fn)``, ``torch.jit.trace(fn,
    example)``: a ``torch.jit.ScriptFunction``) returned by a factory.  It is a torch model:
    it gets ``torch.Tensor`` on ``device``, bound to its parameters as `TorchModuleModel`
    binds a forward's (by name; one tensor positionally whatever its name; else the dict).
    It was wrapped as a numpy callable, called with the dict of numpy arrays, which no
    TorchScript function takes: every request failed ("Expected a value of type 'Tensor'").
    It has no parameters to move or freeze.  Optional attributes set on it are honoured as
    on a module."""

    def __init__(self, fn, *, name: str, device: str = "cpu"):
        self.fn = fn
        self._wrap(fn, _schema_signature(fn, method=False), name=name, device=device)


class TorchExportedModel(_TorchCallModel):
    """Wraps a ``torch.export`` program (an ``ExportedProgram``: ``torch.export.export(...)``,
    or one read back with ``torch.export.load``) returned by a factory: TorchScript's
    successor (torch 2.13 deprecates ``torch.jit.script`` and ``trace``).  It is run as the
    module it makes (``program.module()``, moved to ``device`` first with torch's
    ``move_to_device_pass``), bound as `TorchModuleModel` binds a forward.  An
    ``ExportedProgram`` is callable but refuses every call ("use exported_program.module()"):
    wrapped as a numpy callable, every request failed.

    The worker stacks requests along a new dimension 0 (a batch of one included), so every
    input's dimension 0 is the batch: a program exported with a ``Dim`` for it
    (``dynamic_shapes``) is batched; one exported with a fixed size of 1 there runs each
    request alone (``batchable`` False, unless set on the program); any other fixed size,
    or an input with no dimension, could take no batch the worker makes (its shape guards
    fail every request) and is refused at load, saying so.  Its warm-up is the program's own
    example inputs (the first item of each).  Optional attributes set on the program
    (``batchable``, ``streaming``, ``inputs``, ``outputs``, ``cost``) are honoured as on a
    module; it keeps no name of its own (``name`` on it, else the factory's)."""

    def __init__(self, program, *, name: str, device: str = "cpu"):
        fixed = _fixed_batch(program)
        wrong = sorted(n for n, size in fixed.items() if size != 1)
        if wrong:
            raise ModelLoadError(
                f"the exported program {name!r} fixes dimension 0 of its input(s) {', '.join(wrong)} "
                f"({', '.join(_dim0_words(fixed[n]) for n in wrong)}): the worker stacks requests along a new "
                f"dimension 0, so no batch it makes passes the program's shape guards.  Export it with that "
                f"dimension dynamic (dynamic_shapes={{{wrong[0]!r}: {{0: torch.export.Dim('batch')}}, ...}}), or "
                f"with a batch of 1 to run each request alone")
        passes = sys.modules.get("torch.export.passes")
        if passes is None:
            import torch.export.passes as passes
        move = getattr(passes, "move_to_device_pass", None)
        if move is not None:
            program = move(program, device)
        module = program.module()  # (no eval(): an exported module refuses it; export a model in eval mode)
        for p in module.parameters():
            p.requires_grad_(False)
        for attr in ("batchable", "streaming", "inputs", "outputs", "cost"):  # (its example_inputs are torch's)
            if hasattr(program, attr):
                setattr(module, attr, getattr(program, attr))
        self.program = program
        self.module = module
        self._wrap(module, _forward_signature(module), name=name, device=device)
        if fixed and not hasattr(program, "batchable"):
            self.batchable = False
        # Called as it was exported: its positional arguments by position, its keyword ones
        # by name (the module checks the call against the export's; keywords for its
        # positional parameters are refused: "kwarg keyword mismatch").  A program kept
        # without its example inputs (an older torch's) was called positionally.
        params = list(self._signature.parameters) if self._signature is not None else []
        try:
            args, kwargs = program.example_inputs
            kwargs = dict(kwargs)
        except (TypeError, ValueError):
            args, kwargs = [None] * len(program.graph_signature.user_inputs), {}
        self._positional = tuple(params[:len(args)])
        self._keywords = tuple(kwargs)
        scalars = [n for n, v in [*zip(self._positional, args), *kwargs.items()]
                   if v is not None and not hasattr(v, "detach")]
        if scalars:
            raise ModelLoadError(
                f"the exported program {name!r} takes {', '.join(map(repr, scalars))}, not a tensor: a request "
                f"carries tensors only; export it with those values fixed (closed over in the module), or "
                f"taken as tensors")

    def __call__(self, batch):
        pos, kw = self._positional, self._keywords
        if len(batch) == 1 and len(pos) == 1 and not kw and pos[0] not in batch:
            args = tuple(batch.values())  # one tensor: positionally, whatever its name (as a module's)
        else:
            missing = [n for n in (*pos, *kw) if n not in batch]
            if missing:
                raise InvalidInput(f"the exported program {self.name!r} takes the inputs "
                                   f"{', '.join(map(repr, (*pos, *kw)))}; this request has none named "
                                   f"{', '.join(map(repr, missing))} (it has {', '.join(map(repr, sorted(batch)))})")
            args = tuple(batch[n] for n in pos)
        try:
            out = self._target(*args, **{k: batch[k] for k in kw})
        except (AssertionError, RuntimeError) as e:
            # (a program kept without example inputs checks its inputs itself: RuntimeError
            # "Expected input at ... to be equal to 3, but got 4"; the review)
            if not str(e).startswith(("Guard failed", "Expected input")):
                raise
            # A shape or dtype the program was not exported for: the request's (422), not
            # the model's (500, "retrying may help").
            raise InvalidInput(f"the exported program {self.name!r} does not take these inputs ({e}; dimension 0 "
                               f"is the batch the worker makes: a request carries one item, without it)") from None
        if self.streaming:
            return stream_outputs(out, self.name)
        return normalise_outputs(out, self.name)

    def example_inputs(self):
        """The program's example inputs (what it was exported with: ``(args, kwargs)``), the
        first item of each along dimension 0, by the forward's parameter names."""
        try:
            args, kwargs = self.program.example_inputs
        except (TypeError, ValueError):
            return super().example_inputs()
        if len(args) > len(self._positional):
            return super().example_inputs()
        out = {}
        for key, value in [*zip(self._positional, args), *dict(kwargs).items()]:
            if getattr(value, "ndim", 0) < 1 or not hasattr(value, "detach"):
                return super().example_inputs()
            out[key] = value[0].detach().cpu().numpy()
        return out


def _fixed_batch(program) -> dict[str, int | None]:
    """The inputs of ``program`` whose dimension 0 has a fixed size, with that size (None for
    an input with no dimension); inputs with a dynamic one are left out."""
    user = set(program.graph_signature.user_inputs)
    fixed: dict[str, int | None] = {}
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in user:
            continue
        shape = getattr(node.meta.get("val"), "shape", None)
        if shape is None:
            continue
        if len(shape) == 0:
            fixed[node.name] = None
        elif isinstance(shape[0], int):
            fixed[node.name] = shape[0]
    return fixed


def _dim0_words(size: int | None) -> str:
    return "no dimension" if size is None else f"size {size}"


class CallableModel(ModelBase):
    """Wraps a plain callable ``fn(dict of np.ndarray) -> dict of np.ndarray``.

    The callable sees the batch (leading batch axis).  Like ``TorchModuleModel`` it honours
    optional ``batchable``, ``streaming``, ``cost`` and ``example_inputs`` attributes.
    """

    framework = "numpy"

    def __init__(self, fn: Callable, *, name: str, device: str = "cpu"):
        self.fn = fn
        self.name = name
        self.device = device
        self.batchable = bool(_attr_or(fn, "batchable", True))
        self.streaming = bool(_attr_or(fn, "streaming", False))
        self.inputs = _attr_or(fn, "inputs", None)
        self.outputs = _attr_or(fn, "outputs", None)

    def __call__(self, batch):
        out = self.fn(batch)
        if self.streaming:
            return stream_outputs(out, self.name)
        return normalise_outputs(out, self.name)

    def cost(self, inputs):
        fn = getattr(self.fn, "cost", None)
        return float(fn(inputs)) if callable(fn) else _nbytes(inputs)

    def example_inputs(self):
        ex = getattr(self.fn, "example_inputs", None)
        if ex is None:
            return super().example_inputs()
        return dict(ex() if callable(ex) else ex)


def stream_outputs(out: Any, name: str) -> Iterator[dict]:
    """A streaming model's partials, each normalised: what it returned is iterated, but one
    dict is its one partial (a plain function with ``streaming = True`` that returned a
    dict had its keys iterated, and failed "returned str"; a ModelBase's was one partial)."""
    if isinstance(out, Mapping):
        return iter((normalise_outputs(out, name),))
    return (normalise_outputs(o, name) for o in out)


def normalise_outputs(out, name: str):
    """A model's return value as a dict of named outputs (a lone tensor is output
    "output").  Anything else is `backends.BadOutputs`, the model's mistake, which the same
    request meets again: a plain TypeError was answered as something the model raised,
    "retrying may help" (the models audit)."""
    if isinstance(out, Mapping):
        return out
    if hasattr(out, "shape") and hasattr(out, "dtype"):  # a single tensor or array
        return {"output": out}
    from gpu_worker.backends import BadOutputs  # (on the error path: a backend is running us)

    raise BadOutputs(f"model {name!r} returned {type(out).__name__}; expected a dict of arrays/tensors "
                     "or a single array/tensor")


# --------------------------------------------------------------------------- loading


SHIPPED_MODELS: dict[str, Callable[..., Model]] = {
    "echo": EchoModel,
    "cartoon": CartoonModel,
    "convnet": ConvNetModel,
    "chunks": ChunksModel,
}

_EXPECTED = ("expected a shipped model name (" + ", ".join(SHIPPED_MODELS) + ") or "
             "'package.module:factory', where factory(device=...) or factory() returns a Model, "
             "a torch.nn.Module, or a callable taking and returning a dict of numpy arrays")


def _is_torch_module(obj: object) -> bool:
    # An nn.Module can only exist if torch was imported already; do not import it here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _is_exported_program(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.export`` program, without importing torch."""
    export = sys.modules.get("torch.export")
    program = getattr(export, "ExportedProgram", None)
    return isinstance(program, type) and isinstance(obj, program)


def _is_script_function(obj: object) -> bool:
    """Whether ``obj`` is a TorchScript function (``torch.jit.script`` or ``torch.jit.trace``
    of a plain function), without importing torch."""
    torch = sys.modules.get("torch")
    script_function = getattr(getattr(torch, "jit", None), "ScriptFunction", None)
    return isinstance(script_function, type) and isinstance(obj, script_function)


def _call_factory(factory, device: str):
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return factory()
    takes_device = "device" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return factory(device=device) if takes_device else factory()


def name_problem(name: object, what: str = "model name") -> str | None:
    """Why ``name`` cannot be a service name (it is one, registered with the broker, when no
    ``--service`` is given), or None: a non-empty string of at most `MAX_SERVICE_LEN` UTF-8
    bytes with no whitespace or control characters (they would not survive logs, metrics
    labels and URLs such as /v2/models/{service} unchanged)."""
    from broker.protocol import MAX_SERVICE_LEN, MMI_PREFIX

    if not isinstance(name, str) or not name:
        return f"the {what} {name!r} is not a non-empty string"
    if any("\ud800" <= c <= "\udfff" for c in name):
        # Bytes of an argument that are not UTF-8 (a name typed in Latin-1, any non-ASCII
        # name under PYTHONUTF8=0 LC_ALL=C) arrive as lone surrogates, which are not
        # printable: they were called "whitespace or control characters" (the streams hunt).
        return (f"the {what} {name!r} holds bytes that are not UTF-8 (typed in another encoding, or under a "
                f"locale that is not UTF-8): give it in UTF-8, or run under a UTF-8 locale (LANG=C.UTF-8)")
    if any(c.isspace() or not c.isprintable() for c in name):
        return f"the {what} {name!r} has whitespace or control characters: remove them"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_SERVICE_LEN:
        return f"the {what} {name[:40]!r}... is longer than {MAX_SERVICE_LEN} bytes"
    if name.startswith(MMI_PREFIX):
        return f"the {what} {name!r} starts with {MMI_PREFIX!r}, which the broker keeps for its own queries (MMI)"
    return None


def load_model(spec: str, device: str = "cpu") -> Model:
    """Build the model named by ``spec`` on ``device`` (`_build_model`), and check what it
    declares: a usable name (`name_problem`) and well-formed ``inputs`` and ``outputs``
    (`gpu_worker.signature.parse_inputs`); `ModelLoadError` (one line) otherwise."""
    from gpu_worker.signature import parse_inputs

    model = _build_model(spec, device)
    try:
        name = getattr(model, "name", None)
        declared = {what: getattr(model, what, None) for what in ("inputs", "outputs")}
    except (Exception, SystemExit) as e:  # a property that raises
        raise ModelLoadError(f"model spec {spec!r}: reading the model's name, inputs and outputs raised "
                             f"{type(e).__name__}: {e}") from e
    why = name_problem(name)
    if why is not None:
        raise ModelLoadError(f"{why} (model spec {spec!r}: change the model's `name`)")
    for what, value in declared.items():
        parse_inputs(value, what)
    return model


def _build_model(spec: str, device: str = "cpu") -> Model:
    """Build the model named by ``spec`` on ``device``.

    ``spec`` is a shipped name (see ``SHIPPED_MODELS``) or ``package.module:factory``
    (``factory`` may be a dotted attribute path).  The factory's result is used as is when it
    already implements ``Model``; an ``nn.Module`` is wrapped in ``TorchModuleModel`` (moved
    to ``device``, eval mode), a TorchScript function in ``TorchFunctionModel`` (torch
    tensors in and out, as a module) and any other callable in ``CallableModel``.  A wrapped model
    is named after itself, never after the factory (see ``_model_name``): that name is the
    worker's default service.  Whatever the factory or its result raises (`SystemExit`
    included) is a `ModelLoadError`.
    """
    from .devices import resolve_device

    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"empty model spec {spec!r}: {_EXPECTED}")
    spec = spec.strip()
    device = resolve_device(device)

    if spec in SHIPPED_MODELS:
        try:
            return SHIPPED_MODELS[spec](device=device)
        except ImportError as e:
            raise ModelLoadError(f"model {spec!r} needs torch, which is not importable ({e}); "
                                 "pip install '.[torch]'") from e

    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise ModelLoadError(f"unknown model {spec!r}: {_EXPECTED}")
    if not module_name or not attr:
        raise ModelLoadError(f"malformed model spec {spec!r}: {_EXPECTED}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ModelLoadError(f"cannot import {module_name!r} for model spec {spec!r}: "
                             f"{type(e).__name__}: {e} (is the package on PYTHONPATH?)") from e
    factory: Any = module
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError as e:
            raise ModelLoadError(f"module {module_name!r} has no attribute {attr!r} (model spec {spec!r}; "
                                 "check the name after ':')") from e
    if not callable(factory):
        raise ModelLoadError(f"{spec!r} is a {type(factory).__name__}, not a callable factory: {_EXPECTED}")
    try:
        obj = _call_factory(factory, device)
    except (Exception, SystemExit) as e:
        # SystemExit too: a factory's sys.exit(0) ended the worker with status 0, which a
        # launcher takes for a clean leave (sys.exit("why") with 1 and no line of ours).
        # A KeyboardInterrupt stays Ctrl-C.
        raise ModelLoadError(f"factory {spec!r} raised {type(e).__name__}: {e} "
                             "(fix the factory or what it loads; it is called as factory(device=...) "
                             "or factory())") from e

    if isinstance(obj, type):
        # A class carries every attribute a Model has, so it passed for one, and each call
        # made an instance of it ("missing 1 required positional argument: 'self'" at the
        # warm-up; "object has no attribute 'items'" with --no-warmup: the models audit).
        raise ModelLoadError(f"factory {spec!r} returned the class {obj.__name__}, not an instance of it: return "
                             f"{obj.__name__}(...) ({_EXPECTED})")
    try:
        if _is_model(obj):
            return obj
        if _is_torch_module(obj):
            return TorchModuleModel(obj, name=_model_name(obj, attr), device=device)
        if _is_script_function(obj):
            return TorchFunctionModel(obj, name=_model_name(obj, attr), device=device)
        if _is_exported_program(obj):
            return TorchExportedModel(obj, name=_model_name(obj, attr), device=device)
        if callable(obj):
            return CallableModel(obj, name=_model_name(obj, attr), device=device)
    except ModelLoadError:
        raise  # (a wrapper's own refusal, which says why)
    except (Exception, SystemExit) as e:
        # What the result's own code raised as it was looked at or wrapped (a property, a
        # module's `.to(device)`): it escaped as a traceback, exit 1 (the models audit).
        raise ModelLoadError(f"factory {spec!r} returned a {type(obj).__name__} that cannot be used as a model: "
                             f"{type(e).__name__}: {e} (fix it, or return a Model: docs/models.md)") from e
    raise ModelLoadError(f"factory {spec!r} returned {type(obj).__name__}: {_EXPECTED}")


def _model_name(obj: object, attr: str) -> str:
    """The default service name of a wrapped model: its own ``name`` attribute (a non-empty
    str); else an ``nn.Module``'s class name, lowercased (``Sequential`` -> "sequential"); a
    named function's ``__name__``; a callable object's class name, lowercased.  Only an
    anonymous callable (a lambda) falls back to the factory's name."""
    try:
        name = getattr(obj, "name", None)
    except Exception:  # a property that raises: no name of its own
        name = None
    if isinstance(name, str) and name.strip():
        return name.strip()
    if _is_torch_module(obj):
        jit = getattr(sys.modules["torch"], "jit", None)
        if jit is not None and isinstance(obj, jit.ScriptModule):
            # A scripted or traced module's class is TorchScript's (RecursiveScriptModule,
            # TopLevelTracedModule); the class it was made from is its `original_name`.
            original = getattr(obj, "original_name", None)
            if isinstance(original, str) and original.isidentifier():
                return original.lower()
        return type(obj).__name__.lower()
    if _is_exported_program(obj):
        return attr.rsplit(".", 1)[-1]  # (it keeps no name of the module it was exported from)
    if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isbuiltin(obj):
        fn_name = getattr(obj, "__name__", "")
        if fn_name and fn_name.isidentifier():  # not "<lambda>"
            return fn_name
    elif not isinstance(obj, functools.partial) and type(obj).__name__ != "function":
        return type(obj).__name__.lower()
    return attr.rsplit(".", 1)[-1]
