"""Many `Client`s in one process (the resource audit): libzmq's context allows 1023 sockets
by default, about 250 clients (each takes a DEALER, a reply inbox, a monitor and its pair),
and the 251st got "out of descriptors: raise RLIMIT_NOFILE" with most descriptors free, or
a bare `zmq.ZMQError`.  The SDK asks its context for `sockets.MAX_SOCKETS`; a context an
application filled first is named in a typed error.  Each case in a process of its own (a
context's limit is set before its first socket)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_MAKE = """
import json, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 16384), hard))
import zmq
if int(sys.argv[3]):
    ctx = zmq.Context.instance()
    ctx.max_sockets = int(sys.argv[3])   # an application's own limit, and a socket: the context is started
    keep = ctx.socket(zmq.PUB)
from client_sdk import Client, InferenceError
made, errors = [], []
for i in range(int(sys.argv[2])):
    try:
        made.append(Client(sys.argv[1], timeout=5))
    except InferenceError as e:
        errors.append(("InferenceError", str(e)))
        break
    except Exception as e:
        errors.append((type(e).__name__, str(e)))
        break
for c in made:
    c.close()
print(json.dumps({"made": len(made), "errors": errors}))
"""


def _run(tmp_path, n: int, app_limit: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_RUNTIME_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", _MAKE, f"ipc://{tmp_path}/nobody.ipc", str(n), str(app_limit)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_six_hundred_clients_in_one_process(tmp_path):
    import resource

    import pytest

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"600 clients take about 2,400 descriptors; the hard limit is {hard}")
    got = _run(tmp_path, 600, 0)
    assert got == {"made": 600, "errors": []}


def test_a_context_without_room_is_named_not_the_descriptors(tmp_path):
    got = _run(tmp_path, 100, 40)
    assert got["made"] < 100 and len(got["errors"]) == 1
    kind, words = got["errors"][0]
    assert kind == "InferenceError", got
    assert "ZeroMQ context has no room for another socket" in words and "RLIMIT_NOFILE" not in words, words
