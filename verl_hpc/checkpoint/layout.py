"""The on-disk checkpoint format: names, manifests, verification, listing, safe metadata.

Why separate from the manager: `verl-hpc ckpt list`, the HF exporter and resume logic
read checkpoints without writing any, and must not need a process group to do so.

Layout of `run_dir/checkpoints/`:
    step_00000010/                committed (visible only once complete)
        manifest.json             schema, step, time, files {path: size, sha256}, meta
        .metadata, __R_K.distcp   DCP (tensors only; R = rank in the saving group)
        objects.json              non-tensor leaves of the state, as JSON
        rank{R}/<name>            per-rank small files (rng state...)
        <name>                    shared files written by rank 0 (run state, buffers...)
    .partial-step_00000011-<id>/  a write in progress, or one killed mid-way
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import logging
import os
import pickle
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

log = logging.getLogger(__name__)
# DCP warns on every single-process save/load; that is the intended mode there, not a problem.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

SCHEMA_VERSION = 1
MANIFEST, OBJECTS = "manifest.json", "objects.json"
STEP_RE = re.compile(r"^step_(\d{8,})$")
PARTIAL_RE = re.compile(r"^\.partial-step_(\d{8,})-[0-9a-f]+$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the path and why."""


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    time: float
    size_bytes: int
    status: str  # "committed" | "partial" | "corrupt"
    world_sizes: dict[str, int] = field(default_factory=dict)
    reason: str = ""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --- DCP metadata without arbitrary unpickling ------------------------------------------------

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a DCP metadata file")


def _enum_member(cls: Any, name: Any) -> Any:
    """`getattr(EnumClass, "NAME")` as CPython 3.11.0-3.11.4 pickle an enum member (Debian 12's
    python3 is 3.11.2): only a member of an enum class the allowlist let through."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not allowed in a DCP metadata file")


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's `.metadata`, unpickled with an allowlist of DCP's own metadata classes only."""
    try:
        with open(Path(path) / ".metadata", "rb") as fh:
            return _MetadataUnpickler(io.BytesIO(fh.read())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as err:
        raise CheckpointError(f"{path}/.metadata: cannot read DCP metadata: {err}") from None


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata comes from `read_dcp_metadata` (read once, cached)."""

    def __init__(self, path: Path, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = read_dcp_metadata(Path(self.path))
        if getattr(self._metadata, "storage_meta", None) is not None:
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def check_tensors_only(path: Path, metadata: Metadata) -> None:
    """Refuse a checkpoint holding pickled values: DCP would load them with weights_only=False."""
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise CheckpointError(f"{path}: refusing to load non-tensor value {key!r} (DCP would unpickle it); "
                                  "verl-hpc checkpoints keep non-tensor state in JSON files")


# --- files, manifests, listing ---------------------------------------------------------------

def write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(ckpt: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size + sha256 of `names` (relative), each file fsynced; all of it in parallel threads.

    Why fsync here and in parallel with hashing: DCP writes without fsync, then the flush
    to disk of a file and the sha256 pass over it (from the page cache; hashlib drops the
    GIL) overlap, so the manifest costs about max(flush, hash) instead of their sum.
    """
    with ThreadPoolExecutor(max_workers=min(16, 2 * max(1, len(names)))) as pool:
        flushed = [pool.submit(fsync_path, ckpt / name) for name in names]
        hashes = [pool.submit(sha256_file, ckpt / name) for name in names]
        for future in flushed:
            future.result()
        return {name: {"size": (ckpt / name).stat().st_size, "sha256": digest.result()}
                for name, digest in zip(names, hashes, strict=True)}


def files_of_rank(ckpt: Path, rank: int, world: int) -> list[str]:
    """Files rank `rank` hashes: DCP names each rank's data `__{rank}_*`; rank 0 takes the rest."""
    names = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    others = {r for r in range(world) if r != rank}

    def owner(name: str) -> int:
        m = re.match(r"^(?:__(\d+)_|rank(\d+)/)", name)
        r = int(m.group(1) or m.group(2)) if m else 0
        return r if r < world else 0

    return [n for n in names if n != MANIFEST and owner(n) not in others]


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (not a committed verl-hpc checkpoint)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}/{MANIFEST}: unreadable: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise CheckpointError(f"{path}/{MANIFEST}: unknown schema (expected version {SCHEMA_VERSION})")
    missing = {"step", "time", "files", "total_bytes", "meta"} - set(manifest)
    if missing:
        raise CheckpointError(f"{path}/{MANIFEST}: lacks {sorted(missing)}")
    return manifest


def verify_checkpoint(path: Path, verify: str = "sizes") -> str | None:
    """None when `path` is a complete checkpoint, else why not (one line)."""
    if verify not in ("sizes", "sha256"):
        raise ValueError(f"verify must be 'sizes' or 'sha256', not {verify!r}")
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        return str(err).split(": ", 1)[-1]
    try:
        for name, rec in manifest["files"].items():
            file = Path(path) / name
            if not file.is_file():
                return f"file {name} is missing"
            if file.stat().st_size != rec["size"]:
                return f"file {name} has {file.stat().st_size} bytes, the manifest says {rec['size']}"
            if verify == "sha256" and sha256_file(file) != rec["sha256"]:
                return f"file {name} does not match its sha256 (corrupted)"
    except (AttributeError, KeyError, TypeError):
        return f"{MANIFEST} has a malformed file list"
    return None


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _describe(entry: Path, verify: str) -> CheckpointInfo | None:
    committed, partial = STEP_RE.match(entry.name), PARTIAL_RE.match(entry.name)
    if not entry.is_dir() or not (committed or partial):
        return None
    step = int((committed or partial).group(1))
    if partial:
        return CheckpointInfo(entry, step, entry.stat().st_mtime, _du(entry), "partial",
                              reason="incomplete write (never committed)")
    reason = verify_checkpoint(entry, verify)
    if reason:
        return CheckpointInfo(entry, step, entry.stat().st_mtime, _du(entry), "corrupt", reason=reason)
    manifest = read_manifest(entry)
    sizes = manifest["meta"].get("world_sizes") or {"ranks": manifest.get("world_size", 1)}
    return CheckpointInfo(entry, step, manifest["time"], manifest["total_bytes"], "committed", dict(sizes))


def list_checkpoints(root: Path, verify: str = "sizes") -> list[CheckpointInfo]:
    """Every checkpoint and partial write under `root`, oldest step first.

    Safe to run while the job saves: an entry renamed or pruned meanwhile is left out.
    """
    infos = []
    for entry in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        try:
            info = _describe(entry, verify)
        except FileNotFoundError:
            continue
        if info is not None:
            infos.append(info)
    return sorted(infos, key=lambda i: (i.step, i.status != "committed"))


def latest_checkpoint(root: Path, verify: str = "sizes") -> Path | None:
    """The newest committed checkpoint that verifies; every skipped one is warned about by name.

    Partial writes are reported but left alone: deleting them here could race a save
    that another process of the same run is still writing.
    """
    chosen = None
    for info in reversed(list_checkpoints(root)):
        if info.status != "partial" and chosen is not None:
            continue
        reason = info.reason or (verify_checkpoint(info.path, verify) if verify == "sha256" else None)
        if reason:
            msg = f"skipping checkpoint {info.path}: {reason}"
            if log.hasHandlers():  # else `warnings` alone prints it (no duplicate line on stderr)
                log.warning(msg)
            warnings.warn(msg, stacklevel=2)
        else:
            chosen = info.path
    return chosen


def read_shared(path: Path, name: str) -> bytes:
    return (Path(path) / name).read_bytes()


def read_rank_file(path: Path, rank: int, name: str) -> bytes | None:
    file = Path(path) / f"rank{rank}" / name
    return file.read_bytes() if file.is_file() else None




def checkpoints_root(path: str | os.PathLike) -> Path:
    """RUN_DIR/checkpoints, or `path` itself when it is already a checkpoints directory."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    return root / "checkpoints" if (root / "checkpoints").is_dir() else root


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory as given, or the latest committed one of a run/checkpoints dir."""
    given = Path(path)
    if (given / MANIFEST).is_file():
        return given
    found = latest_checkpoint(checkpoints_root(given))
    if found is None:
        raise CheckpointError(f"{given} is neither a committed checkpoint nor a run with one")
    return found


def check_file_names(files: dict[str, bytes] | None, kind: str) -> None:
    """Caller-named files must not collide with DCP's or the manifest's files."""
    for name in files or {}:
        if not _NAME_RE.match(name) or name in (MANIFEST, OBJECTS) or name.endswith(".distcp"):
            raise CheckpointError(f"{kind} name {name!r} is not allowed (a plain file name, not {MANIFEST}, "
                                  f"{OBJECTS} or *.distcp)")


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def format_table(infos: list[CheckpointInfo]) -> str:
    """The `verl-hpc ckpt list` table: one row per checkpoint or partial write."""
    import datetime

    rows = [("STEP", "TIME", "SIZE", "STATUS", "WORLD SIZES", "REASON")]
    for i in infos:
        when = datetime.datetime.fromtimestamp(i.time).strftime("%Y-%m-%d %H:%M:%S")
        sizes = ",".join(f"{k}={v}" for k, v in i.world_sizes.items()) or "-"
        rows.append((str(i.step), when, _human(i.size_bytes), i.status, sizes, i.reason or "-"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows)
