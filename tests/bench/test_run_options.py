"""`python -m bench run`'s numeric options, checked before anything runs (the configuration
hunt): NaN passed every comparison and infinities got as far as the generators."""
from __future__ import annotations

import pytest

from bench import run as R

BASE = ["--endpoint", "ipc:///nowhere/fe.ipc", "--service", "echo", "--input", "x=4:float32"]


@pytest.mark.parametrize("args, flag", [
    (["--warmup-s", "nan"], "--warmup-s"),        # the generator failed: cannot convert float NaN to integer
    (["--warmup-s", "inf"], "--warmup-s"),
    (["--window-s", "inf"], "--window-s"),        # the generator failed: OverflowError
    (["--window-s", "1e300"], "--window-s"),
    (["--timeout-s", "nan"], "--timeout-s"),      # no timeout at all, without a word
    (["--spin-us", "nan"], "--spin-us"),
    (["--spin-us", "-5"], "--spin-us"),
    (["--max-lateness-ms", "nan"], "--max-lateness-ms"),  # the lateness check off
    (["--max-lateness-ms", "-1"], "--max-lateness-ms"),   # every level INVALID
    (["--slo-ms", "inf"], "--slo-ms"),
    (["--streams-range", "1", "--fps", "inf"], "--fps"),
])
def test_a_number_out_of_its_range_is_a_usage_error_naming_it(args, flag):
    a = R.build_parser().parse_args(BASE + args)
    with pytest.raises(ValueError, match=f"^{flag} must be a number from"):
        R.make_plan(a)


def test_the_defaults_and_plain_values_pass():
    assert R.make_plan(R.build_parser().parse_args(BASE)).levels == [1]
    a = R.build_parser().parse_args(BASE + ["--timeout-s", "0", "--warmup-s", "0", "--spin-us", "0",
                                            "--max-lateness-ms", "0", "--window-s", "0.5"])
    assert R.make_plan(a).cfg["max_lateness_ms"] == 0
