"""Models that start processes of their own as they load, as real ones do (a tokenizer
helper, a shell pipeline, a compile pool), each echoing its inputs.  Loaded as
`--model children_model:orphans` or `children_model:helper`, with this folder on PYTHONPATH.

- `orphans`: three short-lived orphans (`sh -c 'sleep 0.2 & exit 0'`: the shell exits at
  once, so each sleep's parent is gone and the kernel hands it to the nearest reaper: pid 1
  of the pid namespace), which end 0.2 s later and must then be reaped by it.
- `helper`: one long-lived child (`sleep 300`) that the model never stops, as a helper
  process that would outlive a worker killed under it; its pid is appended to
  $HELPER_PIDS.
"""
import os
import subprocess


def _echo(name: str):
    def run(inputs):
        return dict(inputs)

    run.name = name
    return run


def orphans(device: str = "cpu"):
    for _ in range(3):
        subprocess.run(["sh", "-c", "sleep 0.2 & exit 0"], check=True)
    return _echo("orphans")


def helper(device: str = "cpu"):
    p = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    with open(os.environ["HELPER_PIDS"], "a") as f:
        f.write(f"{p.pid}\n")
    return _echo("helper")
