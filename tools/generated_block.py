"""The generated block of a doc page, between its BEGIN/END markers: spliced in, or checked.

Why shared: tools/gen_config_docs.py and tools/gen_verl_docs.py both regenerate one block of a
page from the code, and `--check` (run by the tests) must fail the same way for both.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path


def splice(document: str, block: str, begin: str, end: str, name: str) -> str:
    """`document` with the text between the markers replaced by `block`."""
    if document.count(begin) != 1 or document.count(end) != 1 or document.index(begin) > document.index(end):
        raise ValueError(f"{name} must hold exactly one {begin} ... {end} pair")
    head, rest = document.split(begin)
    return f"{head}{begin}\n{block}{end}{rest.split(end)[1]}"


def write_or_check(doc: Path, name: str, block: str, begin: str, end: str, check: bool, script: str) -> int:
    """Exit code: with `check`, 1 (and a diff) when `doc` is stale; else write it when it changed."""
    current = doc.read_text() if doc.is_file() else ""
    try:
        updated = splice(current, block, begin, end, name)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 1
    if check:
        if updated == current:
            return 0
        diff = difflib.unified_diff(current.splitlines(), updated.splitlines(), "on disk", "generated", lineterm="")
        print("\n".join(list(diff)[:40]), file=sys.stderr)
        print(f"{name} is out of date: run python {script}", file=sys.stderr)
        return 1
    if updated != current:
        doc.write_text(updated)
        print(f"wrote {name}")
    return 0
