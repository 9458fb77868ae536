"""Read a wandb offline run file with wandb's own protobuf, for tests: what `wandb sync` would upload.

Why here and not in the package: it decodes wandb's private file layout (LevelDB's log
format), which only tests need and which a wandb release may change; the checks below
(header, per-record CRC) make such a change fail loudly instead of reading garbage.

Layout (wandb-core's store): a 7-byte header ":W&B", magic 0xBEE1 (2 bytes LE), version 0;
then 32 KiB blocks of records, each a 7-byte header crc32 (4 LE, over the type byte and
the data) + length (2 LE) + type (FULL=1, FIRST=2, MIDDLE=3, LAST=4) and its data. A block's
tail shorter than a header is zero padding. The records' data are `Record` protobufs.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")
RECORD = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    """Every `wandb_internal_pb2.Record` in the file, in order; AssertionError on a format surprise."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert HEADER.unpack_from(data) == (b":W&B", 0xBEE1, 0), f"{path}: not a wandb v0 file"
    pos, parts = HEADER.size, b""
    while pos + RECORD.size <= len(data):
        if BLOCK - pos % BLOCK < RECORD.size:
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = RECORD.unpack_from(data, pos)
        chunk = data[pos + RECORD.size:pos + RECORD.size + length]
        assert kind in (FULL, FIRST, MIDDLE, LAST) and len(chunk) == length, f"{path}@{pos}: bad record"
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}@{pos}: bad checksum"
        pos += RECORD.size + length
        parts = chunk if kind in (FULL, FIRST) else parts + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def history(path: Path) -> dict[int, dict[str, Any]]:
    """step -> {key: value} of the file's history rows (wandb's own `_step`, `_runtime`... included)."""
    rows: dict[int, dict[str, Any]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                   for item in record.history.item}
            rows.setdefault(int(row["_step"]), {}).update(row)
    return rows


def run_record(path: Path) -> Any:
    """The file's `RunRecord` (id, display name, config)."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def offline_runs(root: Path, run_id: str) -> list[Path]:
    """Every attempt's run file for `run_id`, oldest first (directory names start with the time)."""
    return sorted(root.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"),
                  key=lambda p: p.parent.name)


def merged_history(root: Path, run_id: str) -> dict[int, dict[str, Any]]:
    """All attempts' rows, a later attempt's value of a step winning (what metrics.jsonl holds)."""
    out: dict[int, dict[str, Any]] = {}
    for path in offline_runs(root, run_id):
        for step, row in history(path).items():
            out.setdefault(step, {}).update(row)
    return out
