"""Declared model inputs, and the check of a request against them before the model runs.

A model may declare its inputs as ``inputs = {name: (dtype, shape)}``: ``dtype`` is numpy's
``dtype.str`` (``"|u1"``, ``"<f4"``) or None for any; ``shape`` is a tuple whose entries are
sizes or None for a variable axis (``(None, None, 3)``: any height and width, 3 channels),
or None for any shape.  A request whose tensors do not match -- a missing or unexpected
name, another dtype, another rank or size -- is answered ``INVALID_INPUT`` (422) with the
mismatch and the whole expected signature, and never reaches the model: a client mistake
must not look like a server fault.  A model that declares nothing accepts anything (the
model itself may still refuse, which is then a 500).  A model may declare ``outputs`` the
same way: they are not checked, only shown (the broker's ``/v2/models/{service}``).  A
declaration that is not of this form raises `SignatureError` (a `ModelLoadError`: the worker
says so in one line and exits 2).  Pure functions, no model call.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from gpu_worker.models import ModelLoadError

__all__ = ["TensorSpec", "SignatureError", "parse_inputs", "wire_signature", "mismatch", "describe"]

_FORM = ('declare {name: (dtype, shape)}: dtype a numpy dtype string ("<f4", "|u1") or None for any, '
         'shape a tuple of sizes >= 0 with None for any size (or None for any shape), '
         'e.g. {"image": ("|u1", (None, None, 3))} (docs/models.md)')


class SignatureError(ModelLoadError, ValueError):
    """A model's ``inputs`` or ``outputs`` declaration is not of the documented form; the
    message names the entry and what to write instead."""


class TensorSpec(NamedTuple):
    dtype: str | None                        # numpy dtype.str, None: any
    shape: tuple[int | None, ...] | None     # None entries: any size; None: any shape


def parse_inputs(decl: Mapping[str, Any] | None, what: str = "inputs") -> dict[str, TensorSpec] | None:
    """The signature a model declared (its ``inputs`` attribute, or ``what``: "outputs"),
    checked; None if none.  `SignatureError` (one line) for anything else."""
    if decl is None:
        return None
    if not isinstance(decl, Mapping):
        raise SignatureError(f"the model's `{what}` is a {type(decl).__name__}, not a dict; {_FORM}")
    out = {}
    for name, spec in decl.items():
        entry = f"`{what}[{name!r}]` = {spec!r}"[:200]
        if not isinstance(name, str) or not name:
            raise SignatureError(f"the model's `{what}` has the key {name!r}: tensor names are non-empty strings; {_FORM}")
        if isinstance(spec, (str, bytes)) or not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise SignatureError(f"the model declares {entry}, not a (dtype, shape) pair; {_FORM}")
        dtype, shape = spec
        if dtype is not None:
            try:
                dtype = np.dtype(dtype).str
            except (TypeError, ValueError):
                raise SignatureError(f"the model declares {entry}: {dtype!r} is not a numpy dtype; {_FORM}") from None
        if shape is not None:
            if isinstance(shape, (str, bytes)) or not isinstance(shape, (tuple, list)):
                raise SignatureError(f"the model declares {entry}: its shape {shape!r} is not a tuple; {_FORM}")
            if any(d is not None and (isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0)
                   for d in shape):
                raise SignatureError(f"the model declares {entry}: sizes must be integers >= 0 or None; {_FORM}")
            shape = tuple(None if d is None else int(d) for d in shape)
        out[name] = TensorSpec(dtype, shape)
    return out


def wire_signature(sig: Mapping[str, TensorSpec] | None) -> dict | None:
    """A parsed signature as READY carries it (`broker.protocol.Ready.inputs`/``outputs``)."""
    if sig is None:
        return None
    return {name: (spec.dtype, None if spec.shape is None else list(spec.shape)) for name, spec in sig.items()}


def _shape_text(shape: tuple[int | None, ...] | None) -> str:
    if shape is None:
        return "[...]"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def describe(sig: Mapping[str, TensorSpec]) -> str:
    """``image: |u1[?, ?, 3], mask: any[...]``"""
    return ", ".join(f"{n}: {s.dtype or 'any'}{_shape_text(s.shape)}" for n, s in sig.items())


def mismatch(sig: Mapping[str, TensorSpec], tensors: Sequence[Any]) -> str | None:
    """Why ``tensors`` (name, dtype, shape) do not fit ``sig``, or None when they do."""
    got = {t.name: t for t in tensors}
    missing = [n for n in sig if n not in got]
    extra = [n for n in got if n not in sig]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing input{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"unexpected input{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}")
        return " and ".join(parts)
    for name, spec in sig.items():
        t = got[name]
        if spec.dtype is not None and t.dtype != spec.dtype:
            return f"input {name!r} has dtype {t.dtype}, expected {spec.dtype}"
        if spec.shape is not None:
            shape = tuple(t.shape)
            if len(shape) != len(spec.shape) or any(w is not None and w != d for w, d in zip(spec.shape, shape)):
                return f"input {name!r} has shape {list(shape)}, expected {_shape_text(spec.shape)}"
    return None
