"""Declared model inputs, and the check of a request against them before the model runs.

A model may declare its inputs as ``inputs = {name: (dtype, shape)}``: ``dtype`` is numpy's
``dtype.str`` (``"|u1"``, ``"<f4"``) or None for any; ``shape`` is a tuple whose entries are
sizes or None for a variable axis (``(None, None, 3)``: any height and width, 3 channels),
or None for any shape.  A request whose tensors do not match -- a missing or unexpected
name, another dtype, another rank or size -- is answered ``INVALID_INPUT`` (422) with the
mismatch and the whole expected signature, and never reaches the model: a client mistake
must not look like a server fault.  A model that declares nothing accepts anything (the
model itself may still refuse, which is then a 500).  Pure functions, no model call.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

__all__ = ["TensorSpec", "parse_inputs", "mismatch", "describe"]


class TensorSpec(NamedTuple):
    dtype: str | None                        # numpy dtype.str, None: any
    shape: tuple[int | None, ...] | None     # None entries: any size; None: any shape


def parse_inputs(decl: Mapping[str, Any] | None) -> dict[str, TensorSpec] | None:
    """The signature a model declared (its ``inputs`` attribute), checked; None if none."""
    if decl is None:
        return None
    out = {}
    for name, spec in decl.items():
        dtype, shape = spec
        if dtype is not None:
            dtype = np.dtype(dtype).str
        if shape is not None:
            shape = tuple(None if d is None else int(d) for d in shape)
            if any(d is not None and d < 0 for d in shape):
                raise ValueError(f"input {name!r}: sizes must be >= 0 or None, got {shape}")
        out[str(name)] = TensorSpec(dtype, shape)
    return out


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
