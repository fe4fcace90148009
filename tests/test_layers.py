"""The layer table of docs/architecture.md, made true: every import in the project's packages
is read with `ast` (lazy imports inside functions included) and checked against it.

    layer 4   bench                                     may import anything below
    layer 3   broker (state, server, __main__) | gpu_worker | client_sdk
              siblings: none of the three imports another
    layer 2   broker.protocol                           the wire: imports only shm
    layer 1   shm                                       imports nothing of ours

Two more rules: no module imports an underscored name from another module of ours (`from m
import _x`, `import m._x`, or `m._x` on an imported module), and `broker/__init__.py` imports
nothing, so that importing the protocol never loads the broker process.

The checker is a plain function of a source tree, so the tests at the bottom run it on small
trees that break each rule and check that it says so.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "broker", "gpu_worker", "client_sdk", "shm")

# (layer, group): a module may import its own group or any group of a lower layer.
BENCH, BROKER, WORKER, SDK, PROTOCOL, SHM = "bench", "broker", "gpu_worker", "client_sdk", "broker.protocol", "shm"
LAYER = {BENCH: 4, BROKER: 3, WORKER: 3, SDK: 3, PROTOCOL: 2, SHM: 1}


def group_of(module: str) -> str | None:
    """The layer-table group of a dotted module name of ours, None for anything else."""
    if module == PROTOCOL or module.startswith(PROTOCOL + "."):
        return PROTOCOL
    top = module.split(".")[0]
    return top if top in PACKAGES else None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(name: str, root: Path) -> bool:
    p = root.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports_of(path: Path, root: Path):
    """(line, imported module, names or None, alias map) for each import of ours in one file."""
    module = module_name(path, root)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if group_of(a.name):
                    found.append((node.lineno, a.name, None, a.asname))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            if group_of(target):
                found.append((node.lineno, target, [(a.name, a.asname) for a in node.names], None))
    return module, tree, found


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            module, tree, found = imports_of(path, root)
            here = group_of(module)
            where = f"{path.relative_to(root)}"
            if module == "broker" and found:
                out.append(f"{where}: broker/__init__.py must import nothing (it would load the broker process "
                           f"with the protocol)")
            aliases = {}  # local name -> module of ours it is bound to
            for line, target, names, asname in found:
                targets = [target]
                if names is not None:
                    subs = []
                    for name, alias in names:
                        sub = f"{target}.{name}"
                        if _is_module(sub, root):
                            subs.append(sub)
                            aliases[alias or name] = sub
                        elif _private(name) and target != module:
                            out.append(f"{where}:{line}: imports the private name {name!r} from {target}")
                    if subs and len(subs) == len(names):
                        targets = subs  # `from broker import protocol`: the package itself is only a namespace
                else:
                    aliases[asname or target.split(".")[0]] = target if asname else target.split(".")[0]
                    if any(_private(p) for p in target.split(".")):
                        out.append(f"{where}:{line}: imports the private module {target}")
                for t in targets:
                    there = group_of(t)
                    if there == here or there is None:
                        continue
                    if LAYER[there] >= LAYER[here]:
                        kind = "a sibling" if LAYER[there] == LAYER[here] else "a layer above"
                        out.append(f"{where}:{line}: {here} imports {t} ({kind}; see docs/architecture.md)")
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                        and node.value.id in aliases and aliases[node.value.id] != module):
                    out.append(f"{where}:{node.lineno}: uses the private name {node.attr!r} of "
                               f"{aliases[node.value.id]}")
    return out


def test_the_project_keeps_its_layers():
    assert violations() == []


# ------------------------------------------------------------------ the checker itself

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for pkg in PACKAGES + ("broker/protocol",):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, expect", [
    ({"shm/pool.py": "from broker import protocol\n"}, "shm imports broker.protocol (a layer above"),
    ({"broker/protocol/refs.py": "import gpu_worker.worker\n"}, "broker.protocol imports gpu_worker.worker"),
    ({"broker/protocol/refs.py": "from broker import state\n", "broker/state.py": ""},
     "broker.protocol imports broker.state (a layer above"),
    ({"client_sdk/client.py": "def f():\n    from broker.server import Broker\n"},
     "client_sdk imports broker.server (a sibling"),
    ({"gpu_worker/worker.py": "from client_sdk import Client\n"}, "gpu_worker imports client_sdk (a sibling"),
    ({"client_sdk/aio.py": "from .client import _Core\n", "client_sdk/client.py": ""},
     "imports the private name '_Core' from client_sdk.client"),
    ({"bench/x.py": "from bench.peers import _wait_ready\n", "bench/peers.py": ""},
     "imports the private name '_wait_ready' from bench.peers"),
    ({"client_sdk/cuda.py": "from shm.cuda import ipc as ci\nci._tensor_at()\n", "shm/cuda/__init__.py": "",
      "shm/cuda/ipc.py": ""}, "uses the private name '_tensor_at' of shm.cuda.ipc"),
    ({"broker/__init__.py": "from . import protocol\n"}, "broker/__init__.py must import nothing"),
])
def test_the_checker_catches_each_kind_of_break(tmp_path, files, expect):
    if "shm/cuda/ipc.py" in files:
        (tmp_path / "shm" / "cuda").mkdir(parents=True)
    found = violations(_tree(tmp_path, files))
    assert any(expect in v for v in found), found


def test_the_checker_allows_what_the_table_allows(tmp_path):
    files = {
        "bench/x.py": "from client_sdk import Client\nfrom gpu_worker.worker import Worker\nimport broker.server\n",
        "client_sdk/client.py": "from broker import protocol as P\nfrom broker.protocol.wire import send_frames\n"
                                "import shm\nfrom ._core import Core\nx = P.__all__\n",
        "client_sdk/_core.py": "def _mine():\n    pass\n_mine()\n",
        "broker/server.py": "from broker import protocol as P\nfrom broker.state import Scheduler\nfrom shm import gc\n",
        "broker/state.py": "from broker.protocol import ErrorCode\n",
        "broker/protocol/refs.py": "from shm.segment import ShmRef\nfrom .header import ShmLoc\n",
        "broker/protocol/header.py": "", "shm/segment.py": "from .errors import ShmError\n", "shm/errors.py": "",
    }
    assert violations(_tree(tmp_path, files)) == []
