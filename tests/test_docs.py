"""Tables that docs/ shows but code owns: each is rendered from its source of truth between
`<!-- generated: NAME -->` and `<!-- end generated -->`, and this test fails when a page and
its source drift apart.  `python -m tests.test_docs` rewrites the blocks in place.

Also what docs/client.md states about the SDK's surface that a user copies (the `Client`
signature with its defaults, the errors table's classes, bases and codes), and that the
Python examples of README.md and docs/client.md at least compile.  The examples themselves
were run against a broker and workers by the docs hunt; the e2e tests hold their behaviour.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"<!-- generated: (?P<name>[^>]+?) -->\n(?P<body>.*?)<!-- end generated -->\n", re.S)


def _generators():
    from broker.protocol import frames as F
    from shm import segment as S

    return {
        "layout_table(HEADER_FIELDS) in shm/segment.py":
            lambda: S.layout_table(S.HEADER_FIELDS, S.HEADER_DTYPE.itemsize, "meaning"),
        "layout_table(SLOT_FIELDS) in shm/segment.py":
            lambda: S.layout_table(S.SLOT_FIELDS, S.SLOT_SIZE, "written by"),
        "frame_table(MDPC, CLIENT_COMMANDS) in broker/protocol/frames.py":
            lambda: F.frame_table(F.MDPC, F.CLIENT_COMMANDS),
        "frame_table(MDPW, WORKER_COMMANDS) in broker/protocol/frames.py":
            lambda: F.frame_table(F.MDPW, F.WORKER_COMMANDS),
        "frame_table01(MDP01_COMMANDS) in broker/protocol/frames.py":
            lambda: F.frame_table01(F.MDP01_COMMANDS),
    }


def _blocks():
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for m in BLOCK.finditer(text):
            yield page, m


def test_every_generated_block_matches_its_source():
    gens = _generators()
    seen = set()
    for page, m in _blocks():
        name = m.group("name")
        assert name in gens, f"{page.name}: no generator named {name!r}"
        want = gens[name]()
        assert m.group("body") == want, (
            f"{page.name}: the block '{name}' is out of date; run python -m tests.test_docs, "
            f"or paste:\n{want}")
        seen.add(name)
    assert seen == set(gens), f"generated blocks missing from docs/: {sorted(set(gens) - seen)}"


def test_the_frame_table_covers_every_command():
    from broker.protocol import frames as F

    for prefix, table in (("C_", F.CLIENT_COMMANDS), ("W_", F.WORKER_COMMANDS)):
        codes = {v for k, v in vars(F).items() if k.startswith(prefix)}
        assert sorted(c.code for c in table) == sorted(codes)
        for c in table:
            assert getattr(F, prefix + c.name) == c.code
    # MDP/0.1 (section 12.1): every worker command once, each in its own frames' text
    codes = {v for k, v in vars(F).items() if k.startswith("W01_")}
    rows = [c for c in F.MDP01_COMMANDS if c.code]
    assert sorted(c.code for c in rows) == sorted(codes)
    for c in rows:
        assert getattr(F, "W01_" + c.name) == c.code and f"`0x{c.code.hex()}`" in c.frames


CLIENT_MD = DOCS / "client.md"


def test_the_client_signature_in_client_md_is_the_code_s():
    """docs/client.md spells out `Client(endpoint, *, option=default, ...)`: every option and
    its default as `inspect.signature` has them (a user copies the defaults from there)."""
    import inspect

    from client_sdk import AsyncClient, Client

    m = re.search(r"`Client\((endpoint, \*, .*?)\)` and `AsyncClient", CLIENT_MD.read_text(), re.S)
    assert m, "docs/client.md: the Client(endpoint, *, ...) signature line is gone"
    documented = {}
    for part in re.split(r",\s*", m.group(1))[2:]:
        name, default = part.split("=", 1)
        documented[name.strip()] = eval(default)  # literals only: "auto", 256 << 20, None, ...
    for cls in (Client, AsyncClient):
        params = dict(inspect.signature(cls).parameters)
        params.pop("endpoint")
        assert {k: p.default for k, p in params.items()} == documented, cls.__name__


def test_the_error_table_in_client_md_is_the_code_s():
    """Each row of the errors table: the class is importable from client_sdk, derives from
    InferenceError and from what the row says it is also, and carries the row's code."""
    import builtins

    import broker.protocol
    import client_sdk
    import shm

    section = CLIENT_MD.read_text().split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)`(?: \(also (?:a )?`([\w.]+)`\))? \| ([^|]+) \|", section, re.M)
    exported = {n for n in client_sdk.__all__ if isinstance(getattr(client_sdk, n), type)
                and issubclass(getattr(client_sdk, n), client_sdk.InferenceError) and n != "InferenceError"}
    assert sorted(r[0] for r in rows) == sorted(exported), rows  # one row for each error class, no more
    for name, also, code in rows:
        cls = getattr(client_sdk, name)
        assert issubclass(cls, client_sdk.InferenceError), name
        if also:
            mod, _, attr = also.rpartition(".")
            where = {"broker.protocol": broker.protocol, "shm": shm}[mod] if mod else builtins
            base = getattr(where, attr)
            assert issubclass(cls, base), (name, also)
        codes = {None if c.strip() == "–" else int(c) for c in code.split(",")}  # "422, –": either
        assert cls.code in codes, (name, cls.code, code)


def test_the_python_examples_in_readme_and_client_md_compile():
    for page in (DOCS.parent / "README.md", CLIENT_MD):
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            compile(block, f"{page.name} python block {i}", "exec")


def main() -> None:
    gens = _generators()
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        new = BLOCK.sub(lambda m: f"<!-- generated: {m.group('name')} -->\n{gens[m.group('name')]()}"
                                  f"<!-- end generated -->\n", text)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page}", file=sys.stderr)


if __name__ == "__main__":
    main()
