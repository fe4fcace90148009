"""Tables that docs/ shows but code owns: each is rendered from its source of truth between
`<!-- generated: NAME -->` and `<!-- end generated -->`, and this test fails when a page and
its source drift apart.  `python -m tests.test_docs` rewrites the blocks in place.
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
