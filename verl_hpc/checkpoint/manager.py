"""Crash-safe, reshardable training checkpoints: DCP for tensors, JSON for everything else.

Why this shape:
- A checkpoint is written into `root/.partial-step_N-<id>/` and renamed to
  `root/step_{N:08d}/` only after every rank finished and rank 0 wrote and fsynced
  `manifest.json` (size + sha256 of every file): a job killed at any moment leaves either
  no new checkpoint or a complete one, never a half one that resume would load.
- Tensors go through DCP, so N ranks save and M ranks load (with state dicts of their sharding).
- Nothing is unpickled on load beyond DCP's own metadata classes (layout.py). DCP
  would pickle non-tensor values and load them with `weights_only=False`, so the
  non-tensor leaves of the state (optimizer hyper-parameters, counters) are stored as
  JSON in `objects.json` instead (state.py). They must be equal on all ranks (rank 0 writes them);
  per-rank state (RNG) belongs in `rank_files`, run state in `shared_files`.
- Async saves run DCP's collectives over a dedicated gloo group: in a background thread
  on the training group they interleave with the step's collectives and deadlock
  (torch 2.13, /work/shared/NOTES.md). At most one save is in flight.
- Every rank records each save's duration, write to commit (`write_seconds`), for the run's
  time budget (runtime/process/deadline.py). Test-only hook: `VERL_HPC_TEST_COMMIT_DELAY_S`
  seconds of sleep in each commit (rank 0, after the manifest, before the rename).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from verl_hpc.checkpoint.layout import (
    MANIFEST,
    OBJECTS,
    SCHEMA_VERSION,
    STEP_RE,
    CheckpointError,
    CheckpointInfo,
    SafeFileSystemReader,
    check_file_names,
    check_tensors_only,
    file_records,
    files_of_rank,
    fsync_path,
    latest_checkpoint,
    list_checkpoints,
    read_dcp_metadata,
    read_manifest,
    read_rank_file,
    read_shared,
    step_dir_name,
    write_file,
)
from verl_hpc.checkpoint.state import restore_objects, split_items, to_json, unwrap_stateful

COMMIT_DELAY_ENV = "VERL_HPC_TEST_COMMIT_DELAY_S"  # test-only: seconds rank 0 sleeps inside each commit

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointManager", "latest_checkpoint", "list_checkpoints",
           "read_manifest", "read_rank_file", "read_shared", "step_dir_name"]

log = logging.getLogger(__name__)


class _ReusedStager(BlockingAsyncStager):
    """Async staging into one CPU copy reused across saves (pinned only when CUDA is present).

    Why: a fresh copy per save makes the stall page-fault bound (measured 2-10x slower than
    copying into warm memory on CPU). Costs one CPU copy of this rank's state, kept.
    """

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=True)
        self._signature: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        signature = _signature(state_dict)
        if self.state_dict_cache is None or signature != self._signature:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._signature = signature
        return _copy_state_dict(state_dict, self.state_dict_cache)


def _root_cause(err: BaseException) -> BaseException:
    """The OSError under DCP's wrappers (per-rank failures, exception chains), else `err`."""
    seen, todo = set(), [err]
    while todo:
        exc = todo.pop(0)
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        failures = getattr(exc, "failures", None)  # {rank: (exception, stack)} in torch 2.13
        for failure in failures.values() if isinstance(failures, dict) else []:
            first = failure[0] if isinstance(failure, tuple) and failure else failure
            todo += [first] if isinstance(first, BaseException) else []
        todo += [e for e in (exc.__cause__, exc.__context__) if e is not None]
    return err


def _signature(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        local = node.to_local() if hasattr(node, "to_local") else node
        return (tuple(local.shape), node.dtype, node.device.type, type(node).__name__)
    return tuple((k, _signature(v)) for k, v in node.items())


class CheckpointManager:
    """Save, find and load the checkpoints of one run (`root` = `run_dir/checkpoints`).

    Every rank of `process_group` (the training group; the default group when None)
    constructs one, in the same order, and calls `save`/`load` with its own shards.
    `rank` is used only when torch.distributed is not initialised; otherwise the rank in
    `process_group` is taken. Async saves need a gloo group over the same ranks: pass
    `async_group` (created on every rank of the world, like any `new_group`), or leave it
    None when `process_group` spans the whole world and one is created here (with
    `timeout`; torch's default is 30 min). `reuse_staging` keeps one CPU copy of the state
    between async saves (faster stall, more memory). `write_threads` files per rank are
    written (and hashed) in parallel: 2 halved the sync save on a 2-core machine.
    """

    def __init__(self, root: Path, keep_last: int = 2, keep_every: int | None = None, async_save: bool = True,
                 process_group: ProcessGroup | None = None, rank: int = 0,
                 async_group: ProcessGroup | None = None, reuse_staging: bool = True,
                 timeout: timedelta | None = None, write_threads: int = 2) -> None:
        if keep_last < 1 or (keep_every is not None and keep_every < 1):
            raise ValueError("keep_last must be >= 1 and keep_every None or >= 1")
        self.root, self.keep_last, self.keep_every = Path(root), keep_last, keep_every
        self.async_save, self.process_group = async_save, process_group
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self._dist else rank
        self.world_size = dist.get_world_size(process_group) if self._dist else 1
        if self.rank < 0:
            raise ValueError("this process is not a member of process_group")
        self._side_group = self._make_side_group(async_group, timeout)
        if async_save and self._dist and self._side_group is None:
            raise ValueError("async checkpoints over a sub-group of the world need async_group: create it on "
                             "every rank with dist.new_group(ranks, backend='gloo') (new_group is collective "
                             "over the world) and pass it here")
        self._stager = _ReusedStager() if reuse_staging else None
        self._write_threads = max(1, write_threads)
        self._pending: Future | None = None
        # One thread for the manager's life: commits in save order, their collectives matching. Started
        # now, not at the first save, so a run's thread count is flat from its first step.
        self._commit_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        if async_save:
            self._commit_thread.submit(lambda: None)
        self._pending_since: float | None = None  # monotonic start of the async save in flight
        self.commits: list[dict[str, Any]] = []  # rank 0: step, save_seconds, bytes of each commit, unread
        self.write_seconds: list[float] = []    # every rank: start to commit of each save, unread
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    def _make_side_group(self, given: ProcessGroup | None, timeout: timedelta | None) -> ProcessGroup | None:
        """A gloo group for DCP's async collectives and our own small ones (name, hashes, outcome)."""
        if not self._dist or given is not None:
            return given
        if dist.get_world_size(self.process_group) == dist.get_world_size():
            return dist.new_group(backend="gloo", timeout=timeout)
        return None

    # --- saving ------------------------------------------------------------------------------

    def save(self, step: int, tensors: Mapping[str, Any], meta: dict[str, Any],
             rank_files: dict[str, bytes] | None = None, shared_files: dict[str, bytes] | None = None,
             block: bool | None = None) -> Path:
        """Write checkpoint `step`; returns the path it has (or will have, when async) once committed.

        Async (async_save and block is not True): returns once the tensors are staged in CPU
        memory; the write, the manifest and the commit finish in the background. A failure
        there is raised by the next `save`/`wait`. `meta` must be JSON (config hash, world
        sizes, policy version, `model_dir` for export...).
        """
        self.wait()
        use_async = self.async_save and block is not True
        plain, _ = unwrap_stateful(tensors)
        objects: list = []
        tensor_state = split_items(plain.items(), (), objects)
        try:
            objects_json = json.dumps([[list(p), to_json(v, ".".join(p))] for p, v in objects]).encode()
            json.dumps(meta)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint meta/state must be JSON: {err}") from None
        check_file_names(rank_files, "rank file")
        check_file_names(shared_files, "shared file")
        partial = self.root / self._broadcast(f".partial-{step_dir_name(step)}-{uuid.uuid4().hex[:12]}")
        partial.mkdir(parents=True, exist_ok=True)
        for name, data in (rank_files or {}).items():
            write_file(partial / f"rank{self.rank}" / name, data)
        if self.rank == 0:
            write_file(partial / OBJECTS, objects_json)
            for name, data in (shared_files or {}).items():
                write_file(partial / name, data)
        info = {"step": step, "meta": meta, "async": use_async, "start": time.time(), "clock": time.monotonic()}
        # No fsync by DCP: file_records fsyncs each file while hashing it (overlapped).
        writer = dcp.FileSystemWriter(partial, sync_files=False, thread_count=self._write_threads)
        if not use_async:
            try:
                dcp.save(tensor_state, storage_writer=writer, process_group=self.process_group)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # DCP's CheckpointException is a BaseException; ENOSPC hides in it
                raise self._write_error(partial, info, err) from err
            return self._finish(partial, info)
        response = dcp.async_save(tensor_state, storage_writer=writer, process_group=self._side_group,
                                  async_stager=self._stager)
        upload = getattr(response, "upload_completion", response)
        # The commit runs on our own thread, never inline: a write that ends before a callback is
        # attached would run the callback (hashing, fsync, the commit) on the trainer's thread.
        self._pending = self._commit_thread.submit(self._commit_after_write, upload, partial, info)
        self._pending_since = info["clock"]
        return self.root / step_dir_name(step)

    def _commit_after_write(self, written: Future, partial: Path, info: dict[str, Any]) -> Path:
        """Waits for DCP's async write, then commits; an error is kept for whoever waits."""
        try:
            written.result()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException is a BaseException; ENOSPC hides in it
            raise self._write_error(partial, info, err) from err
        return self._finish(partial, info)

    def _write_error(self, partial: Path, info: dict[str, Any], err: BaseException) -> CheckpointError:
        """One line that says what failed, how much space is left, and which checkpoint still holds.

        Why: a full disk reaches us as torch's "unexpected pos 704 vs 598" from the zip writer;
        the free space on the file system is what the user needs to see.
        """
        try:
            free = f"{shutil.disk_usage(self.root).free / 2**20:.1f} MiB free on that file system"
        except OSError:
            free = "free space unknown"
        previous = latest_checkpoint(self.root)
        cause = _root_cause(err)
        detail = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
        return CheckpointError(f"checkpoint step {info['step']} could not be written to {partial} ({detail}); "
                               f"{free}; the last committed checkpoint is intact: {previous or 'none yet'} "
                               "(hint: free space or move the run directory, then run the same command to "
                               "resume from it)")

    def wait(self) -> Path | None:
        """Block until the in-flight async save is committed; its path, or None if none was pending.

        Visibility is guaranteed on every rank when this returns (rank 0 commits before the
        ranks learn the outcome). Raises the save's error, once.
        """
        pending, self._pending, self._pending_since = self._pending, None, None
        return pending.result() if pending is not None else None

    close = wait

    @property
    def pending(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def settled(self, timeout: float | None = None) -> bool:
        """From any thread: wait up to `timeout` s for the async save in flight to end (its result
        stays for the next `save`/`wait`); True when none is left writing."""
        pending = self._pending
        return pending is None or bool(wait_futures([pending], timeout=timeout).done)

    @property
    def pending_since(self) -> float | None:
        """When (time.monotonic) the async save still writing started; None when none is."""
        return self._pending_since if self.pending else None

    def _finish(self, partial: Path, info: dict[str, Any]) -> Path:
        """Every rank hashes its own files; rank 0 commits and prunes; all learn the outcome."""
        try:
            records: dict | str = file_records(partial, files_of_rank(partial, self.rank, self.world_size))
        except OSError as err:
            records = f"rank {self.rank}: {err}"
        gathered = self._gather(records)
        target = self.root / step_dir_name(info["step"])
        error = None
        if self.rank == 0:
            try:
                failed = [r for r in gathered if isinstance(r, str)]
                if failed:
                    raise OSError("; ".join(failed))
                self._commit(partial, target, {k: v for r in gathered for k, v in r.items()}, info)
            except Exception as err:  # every rank must learn it, not only rank 0
                error = f"{type(err).__name__}: {err}"
            else:
                self._prune(target)
        error = self._broadcast(error)
        if error:
            raise CheckpointError(f"step {info['step']} was written to {partial} but not committed: {error}")
        self.write_seconds.append(time.monotonic() - info["clock"])
        return target

    def _commit(self, partial: Path, target: Path, files: dict[str, Any], info: dict[str, Any]) -> None:
        manifest = {
            "format": "verl-hpc checkpoint", "schema_version": SCHEMA_VERSION, "step": info["step"],
            "time": time.time(), "save_seconds": round(time.time() - info["start"], 3),
            "async": info["async"], "world_size": self.world_size, "files": dict(sorted(files.items())),
            "total_bytes": sum(rec["size"] for rec in files.values()), "meta": info["meta"],
        }
        write_file(partial / MANIFEST, json.dumps(manifest, indent=1).encode())
        for directory in [*(p for p in partial.iterdir() if p.is_dir()), partial]:
            fsync_path(directory)
        time.sleep(float(os.environ.get(COMMIT_DELAY_ENV) or 0))  # the test hook (module docstring)
        if target.exists():  # a step saved again after a resume from an older checkpoint
            self._trash(target)
        os.rename(partial, target)
        fsync_path(self.root)
        self.commits.append({"step": info["step"], "save_seconds": manifest["save_seconds"],
                             "bytes": manifest["total_bytes"]})
        log.info("checkpoint %s committed (%d bytes)", target, manifest["total_bytes"])

    def _prune(self, newest: Path) -> None:
        """Keep the newest `keep_last`, every `keep_every`-th step and `newest`; never fail a save."""
        try:
            steps = {int(m.group(1)): p for p in self.root.iterdir() if (m := STEP_RE.match(p.name))}
            order = sorted(steps)
            keep = set(order[-self.keep_last:]) | {int(STEP_RE.match(newest.name).group(1))}
            keep |= {s for s in order if self.keep_every and s % self.keep_every == 0}
            for step in order:
                if step not in keep:
                    self._trash(steps[step])
            for leftover in self.root.glob(".trash-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError as err:
            log.warning("checkpoint retention in %s failed: %s", self.root, err)

    def _trash(self, path: Path) -> None:
        """Rename first (atomic), then delete: a killed deletion never leaves a half `step_*`."""
        trash = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _gather(self, obj: Any) -> list[Any]:
        if not self._dist:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, group=self._side_group or self.process_group, group_dst=0)
        return out or []

    def _broadcast(self, obj: Any) -> Any:
        if not self._dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._side_group or self.process_group, group_src=0)
        return box[0]

    # --- finding and loading -----------------------------------------------------------------

    def latest(self, verify: str = "sizes") -> Path | None:
        """The newest committed checkpoint that verifies ("sizes" or "sha256"); skipped ones warn."""
        return latest_checkpoint(self.root, verify)

    def recover(self) -> list[CheckpointInfo]:
        """Report (warn about) partial writes left by a killed job; they are kept, and skipped."""
        partial = [i for i in list_checkpoints(self.root) if i.status == "partial"]
        for info in partial:
            log.warning("checkpoint write %s was never committed (the job died while saving); ignored",
                        info.path)
        return partial

    def load(self, path: Path, tensors: dict[str, Any]) -> dict[str, Any]:
        """Fill `tensors` (state dicts for this process's sharding) in place; returns the manifest.

        Non-tensor leaves are replaced by the JSON values saved; a checkpoint whose DCP
        metadata holds pickled values is refused (CheckpointError, a ValueError, names the key).
        """
        self.wait()
        path = Path(path)
        manifest = read_manifest(path)
        metadata = read_dcp_metadata(path)
        check_tensors_only(path, metadata)
        plain, stateful = unwrap_stateful(tensors)
        tensor_state = split_items(plain.items(), (), [])
        dcp.load(tensor_state, storage_reader=SafeFileSystemReader(path, metadata),
                 process_group=self.process_group)
        if (path / OBJECTS).is_file():
            restore_objects(plain, json.loads((path / OBJECTS).read_text()))
        for key, value in plain.items():
            if key in stateful:
                stateful[key].load_state_dict(value)
            else:
                tensors[key] = value
        return manifest

    read_shared = staticmethod(read_shared)
    read_rank_file = staticmethod(read_rank_file)
