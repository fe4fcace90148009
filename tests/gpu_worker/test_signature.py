"""Declared inputs: what matches, and the message for what does not."""
import pytest

from broker import protocol as P
from gpu_worker.signature import describe, mismatch, parse_inputs

SIG = parse_inputs({"image": ("|u1", (None, None, 3)), "scale": ("<f4", ())})


def _t(name, dtype, shape):
    return P.TensorRef(name=name, dtype=dtype, shape=list(shape), loc=P.InlineLoc(frame=0))


def test_matching_requests_pass_whatever_the_variable_axes():
    assert mismatch(SIG, [_t("image", "|u1", (720, 1280, 3)), _t("scale", "<f4", ())]) is None
    assert mismatch(SIG, [_t("scale", "<f4", ()), _t("image", "|u1", (1, 1, 3))]) is None


@pytest.mark.parametrize("tensors, why", [
    ([_t("image", "|u1", (4, 4, 3))], "missing input 'scale'"),
    ([_t("img", "|u1", (4, 4, 3)), _t("scale", "<f4", ())], "missing input 'image' and unexpected input 'img'"),
    ([_t("image", "<f4", (4, 4, 3)), _t("scale", "<f4", ())], "input 'image' has dtype <f4, expected |u1"),
    ([_t("image", "|u1", (4, 4, 4)), _t("scale", "<f4", ())], "input 'image' has shape [4, 4, 4], expected [?, ?, 3]"),
    ([_t("image", "|u1", (4, 3)), _t("scale", "<f4", ())], "input 'image' has shape [4, 3], expected [?, ?, 3]"),
])
def test_each_mismatch_is_named(tensors, why):
    assert mismatch(SIG, tensors) == why


def test_the_signature_reads_as_declared():
    assert describe(SIG) == "image: |u1[?, ?, 3], scale: <f4[]"
    assert describe(parse_inputs({"x": (None, None)})) == "x: any[...]"
    assert parse_inputs(None) is None
    with pytest.raises(ValueError):
        parse_inputs({"x": ("|u1", (-1,))})


def test_outputs_parse_like_inputs_and_travel_as_ready_carries_them():
    from gpu_worker.signature import SignatureError, wire_signature

    sig = parse_inputs({"logits": ("<f4", (1000,)), "any": (None, None)}, "outputs")
    assert wire_signature(sig) == {"logits": ("<f4", [1000]), "any": (None, None)}
    assert wire_signature(None) is None
    ready = P.Ready(inputs=wire_signature(SIG), outputs=wire_signature(sig))
    back = P.decode_ready(P.encode_header(ready))
    assert back.outputs == {"logits": ("<f4", [1000]), "any": (None, None)}
    with pytest.raises(SignatureError, match=r"`outputs\['y'\]` = 'nonsense', not a \(dtype, shape\) pair"):
        parse_inputs({"y": "nonsense"}, "outputs")
