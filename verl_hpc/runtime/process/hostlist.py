"""Slurm's compressed lists, read: `node[1-3,7]` node lists and `2,1(x3)` tasks-per-node counts.

Why our own parser beside scontrol's: a task inside a container, or a machine without Slurm's
client tools, still has to read the variables Slurm set; `scontrol show hostnames` is the
reference and is preferred when present.
"""

from __future__ import annotations

import re
import shutil
import subprocess

SCONTROL_TIMEOUT_S = 10.0


def expand_hostlist(spec: str) -> list[str]:
    """Expand Slurm hostlist syntax: `node[01-03,7],gpu5` -> node01, node02, node03, node7, gpu5.

    Why our own parser: containers often lack `scontrol` (a top complaint of RL users on
    Slurm), yet the rendezvous host must be known on every task. Zero padding follows the
    width of a range's first bound, as Slurm does; several brackets in one name expand as
    a product (`r[1-2]n[1-2]`).
    """
    hosts: list[str] = []
    for item in _split_top_level(spec.strip()):
        hosts.extend(_expand_item(item.strip()))
    return hosts


def _split_top_level(spec: str) -> list[str]:
    """Split on commas that are outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {spec!r}")
        elif char == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {spec!r}")
    items.append(spec[start:])
    return [item for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end():]
    tails = _expand_item(tail) if tail else [""]
    return [head + value + rest for value in _expand_ranges(match.group(1), item) for rest in tails]


def _expand_ranges(body: str, item: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in hostlist item {item!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in hostlist item {item!r}")
        values.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return values


def hostnames(nodelist: str) -> list[str]:
    """Hostnames of a Slurm nodelist: `scontrol show hostnames` when present, else our parser.

    Why prefer scontrol: it is the reference implementation (site-specific syntax too);
    the parser is the fallback for containers and for machines without Slurm.
    """
    if shutil.which("scontrol"):
        try:
            done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                  text=True, timeout=SCONTROL_TIMEOUT_S, check=False)
            names = done.stdout.split()
            if done.returncode == 0 and names:
                return names
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_hostlist(nodelist)


def parse_tasks_per_node(spec: str) -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]: Slurm's compressed tasks-per-node list, one entry per node."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"cannot parse tasks per node {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
