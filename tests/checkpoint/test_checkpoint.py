"""Checkpoints: exact round trips, atomic commits, retention, kill -9, resharding, safe loads, export."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from verl_hpc.checkpoint.layout import list_checkpoints, read_manifest
from verl_hpc.checkpoint.manager import CheckpointError, CheckpointManager, read_rank_file, read_shared
from verl_hpc.runtime.process.env import free_port
from verl_hpc.utils.proc import exit_now

# DCP announces every single-process save/load; expected here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model_and_optim(model_dir: Path, lr: float = 1e-2, steps: int = 1):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    for i in range(steps):
        _train_step(model, optim, seed=i)
    return model, optim


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(2, 60, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim)
    return {"actor": {"model": msd, "optim": osd}}


def _assert_equal_states(a: dict, b: dict) -> None:
    for key, value in a.items():
        if isinstance(value, dict):
            _assert_equal_states(value, b[key])
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def test_round_trip_single_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, optim = _model_and_optim(tiny_model_dir, steps=2)
    saved = _state(model, optim)
    mgr = CheckpointManager(tmp_path / "checkpoints", keep_last=2, keep_every=None, async_save=False)
    meta = {"config_hash": "abc", "world_sizes": {"actor": 1}, "policy_version": 3}
    path = mgr.save(3, saved, meta, rank_files={"rng.json": b'{"seed": 1}'},
                    shared_files={"run_state.json": b'{"step": 3}'})
    assert path == tmp_path / "checkpoints" / "step_00000003" and path.is_dir()
    manifest = read_manifest(path)
    assert manifest["step"] == 3 and manifest["meta"] == meta and manifest["world_size"] == 1
    assert {".metadata", "objects.json", "rank0/rng.json", "run_state.json"} <= set(manifest["files"])
    assert manifest["total_bytes"] == sum(f["size"] for f in manifest["files"].values())
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    assert read_shared(path, "run_state.json") == b'{"step": 3}'
    assert read_rank_file(path, 0, "rng.json") == b'{"seed": 1}' and read_rank_file(path, 1, "rng.json") is None

    fresh_model, fresh_optim = _model_and_optim(tiny_model_dir, lr=0.5, steps=0)
    target = _state(fresh_model, fresh_optim)
    assert mgr.load(mgr.latest(), target)["step"] == 3
    _assert_equal_states(saved, target)
    assert target["actor"]["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuple restored
    set_state_dict(fresh_model, fresh_optim, model_state_dict=target["actor"]["model"],
                   optim_state_dict=target["actor"]["optim"])
    assert fresh_optim.param_groups[0]["lr"] == 1e-2
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_async_save_commits_in_background_and_serialises(tmp_path: Path, monkeypatch) -> None:
    gate = threading.Event()
    finish = dcp.FileSystemWriter.finish

    def gated_finish(self, *args, **kwargs):
        assert gate.wait(30)
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemWriter, "finish", gated_finish)
    mgr = CheckpointManager(tmp_path, keep_last=5, keep_every=None, async_save=True)
    weights = torch.arange(1000.0)
    first = mgr.save(1, {"w": weights}, {})
    weights.add_(1)  # training goes on: the checkpoint must hold the values at save time
    assert not first.exists() and mgr.pending
    second_done = threading.Event()
    thread = threading.Thread(target=lambda: (mgr.save(2, {"w": weights}, {}), second_done.set()))
    thread.start()
    assert not second_done.wait(0.3)  # the second save waits for the first
    gate.set()
    thread.join(30)
    assert second_done.is_set() and first.is_dir()
    assert mgr.wait() == tmp_path / "step_00000002"
    loaded = {"w": torch.zeros(1000)}
    mgr.load(first, loaded)
    assert torch.equal(loaded["w"], torch.arange(1000.0))


def _save_steps(mgr: CheckpointManager, steps: range) -> None:
    for step in steps:
        mgr.save(step, {"w": torch.full((64,), float(step)), "step": step}, {"world_sizes": {"actor": 1}})
    mgr.wait()


def test_latest_skips_partial_truncated_and_bitflipped(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=5, keep_every=None, async_save=False)
    _save_steps(mgr, range(1, 4))
    partial = tmp_path / ".partial-step_00000004-0123abcd"
    shutil.copytree(tmp_path / "step_00000003", partial)
    (partial / "manifest.json").unlink()
    with open(partial / "__0_0.distcp", "r+b") as fh:
        fh.truncate(10)
    with pytest.warns(UserWarning, match=str(partial)):
        assert mgr.latest() == tmp_path / "step_00000003"
    assert [info.path for info in mgr.recover()] == [partial] and partial.is_dir()  # reported, kept

    with open(tmp_path / "step_00000003" / "__0_0.distcp", "r+b") as fh:
        fh.truncate(10)
    with pytest.warns(UserWarning, match=r"step_00000003.*bytes"):
        assert mgr.latest() == tmp_path / "step_00000002"

    data = tmp_path / "step_00000002" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mgr.latest() == tmp_path / "step_00000002"  # sizes still match
    with pytest.warns(UserWarning, match=r"step_00000002.*sha256"):
        assert mgr.latest(verify="sha256") == tmp_path / "step_00000001"
    loaded = {"w": torch.zeros(64), "step": 0}
    mgr.load(tmp_path / "step_00000001", loaded)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.full((64,), 1.0))
    statuses = {(i.step, i.status) for i in list_checkpoints(tmp_path)}
    assert statuses == {(1, "committed"), (2, "committed"), (3, "corrupt"), (4, "partial")}


def test_retention_keeps_last_and_every(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_every=4, async_save=True)
    _save_steps(mgr, range(1, 11))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_{s:08d}" for s in (4, 8, 9, 10)]


_KILL_SCRIPT = """
import sys, torch
from pathlib import Path
from verl_hpc.checkpoint.manager import CheckpointManager
mgr = CheckpointManager(Path(sys.argv[1]), keep_last=2, keep_every=None, async_save=False)
for step in range(1, 10000):
    mgr.save(step, {"w": torch.full((8 << 20,), float(step))}, {"step": step})
    print("committed", step, flush=True)
"""


def test_sigkill_mid_write_leaves_last_committed(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        deadline = time.monotonic() + 30
        while not any(tmp_path.glob(".partial-step_00000003-*/__0_*.distcp")) and time.monotonic() < deadline:
            time.sleep(0.001)  # until step 3's tensor data is being written
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert lines[-1].split() == ["committed", "2"]
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_every=None, async_save=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = mgr.latest(verify="sha256")
    step = read_manifest(latest)["step"]
    assert latest.name == f"step_{step:08d}"
    if step == 2:  # killed inside step 3's write (always, unless the commit won the race by microseconds)
        assert any(".partial-step_00000003-" in str(w.message) for w in caught)
    else:
        assert step == 3
    loaded = {"w": torch.zeros(8 << 20)}
    mgr.load(latest, loaded)
    assert bool((loaded["w"] == float(step)).all())


# --- multi-process: FSDP2 saved by 2 ranks, loaded by 1 and by 4 -------------------------------


def _spawn(fn, world: int, *args, deadline: float = 90.0) -> None:
    ctx = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=False,
                             start_method="spawn")
    start = time.monotonic()
    while not ctx.join(timeout=1):
        if time.monotonic() - start > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"{world} ranks did not finish within {deadline} s (deadlock?)")


def _sharded(model_dir: str):
    from transformers import AutoModelForCausalLM

    from verl_hpc.roles.fsdp import shard_model

    model = shard_model(AutoModelForCausalLM.from_pretrained(model_dir), dist.group.WORLD, "cpu")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(state: dict) -> dict[str, torch.Tensor]:
    from verl_hpc.utils.dtensor import full_tensor

    model, optim = state["actor"]["model"], state["actor"]["optim"]["state"]
    out = {f"param/{k}": full_tensor(v).clone() for k, v in model.items()}
    out |= {f"exp_avg/{k}": full_tensor(v["exp_avg"]).clone() for k, v in optim.items()}
    return out


def _rank_main(rank: int, world: int, port: int, job: str, model_dir: str, work: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        model, optim = _sharded(model_dir)
        root = Path(work) / "checkpoints"
        if job == "save":
            _train_step(model, optim, seed=0)
            mgr = CheckpointManager(root, keep_last=2, keep_every=None, async_save=True,
                                    timeout=timedelta(seconds=60))
            state = _state(model, optim)
            mgr.save(1, state, {"world_sizes": {"actor": world}, "model_dir": model_dir},
                     rank_files={"rng.json": json.dumps({"rank": rank}).encode()})
            reference = _full(state)  # collectives on the training group while the save runs
            _train_step(model, optim, seed=1)  # and a training step before it completes
            mgr.wait()
            if rank == 0:
                torch.save(reference, Path(work) / "reference.pt")
        else:
            mgr = CheckpointManager(root, keep_last=2, keep_every=None, async_save=False)
            state = _state(model, optim)
            mgr.load(mgr.latest(), state)
            set_state_dict(model, optim, model_state_dict=state["actor"]["model"],
                           optim_state_dict=state["actor"]["optim"])
            loaded = _full(_state(model, optim))
            if rank == 0:
                torch.save(loaded, Path(work) / f"loaded_{world}.pt")
    finally:
        dist.destroy_process_group()
    exit_now(0)  # done and written: no teardown abort (verl_hpc/utils/proc.py)


def test_reshard_2_ranks_to_1_and_4(tiny_model_dir: Path, tmp_path: Path) -> None:
    _spawn(_rank_main, 2, "save", str(tiny_model_dir), str(tmp_path))
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    path = tmp_path / "checkpoints" / "step_00000001"
    assert read_manifest(path)["world_size"] == 2
    assert json.loads(read_rank_file(path, 1, "rng.json")) == {"rank": 1}

    model, optim = _model_and_optim(tiny_model_dir, steps=0)  # one process, no process group
    state = _state(model, optim)
    CheckpointManager(tmp_path / "checkpoints", 2, None, async_save=False).load(path, state)
    loaded = {f"param/{k}": v for k, v in state["actor"]["model"].items()}
    loaded |= {f"exp_avg/{k}": v["exp_avg"] for k, v in state["actor"]["optim"]["state"].items()}
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)

    _spawn(_rank_main, 4, "load", str(tiny_model_dir), str(tmp_path))
    loaded = torch.load(tmp_path / "loaded_4.pt", weights_only=True)
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)

    from safetensors.torch import load_file

    from verl_hpc.checkpoint.export import export_hf

    exported = load_file(export_hf(path, tmp_path / "hf") / "model.safetensors")  # shards reassembled
    assert exported.keys() == {k[len("param/"):] for k in reference if k.startswith("param/")} - {"lm_head.weight"}
    assert all(torch.equal(v, reference[f"param/{k}"]) for k, v in exported.items())


# --- safety: nothing but tensors and JSON ------------------------------------------------------

class _Opaque:
    pass


def test_non_tensor_state_is_refused(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_every=None, async_save=False)
    with pytest.raises(CheckpointError, match="extra.thing"):
        mgr.save(1, {"w": torch.ones(3), "extra": {"thing": _Opaque()}}, {})
    path = mgr.save(1, {"w": torch.ones(3)}, {})
    # A checkpoint written by plain DCP with a pickled value in it (another tool, or tampering).
    dcp.save({"w": torch.ones(3), "extra": {"note": {1, 2}}}, checkpoint_id=path)
    with pytest.raises(ValueError, match="extra.note"):
        mgr.load(path, {"w": torch.zeros(3)})

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="not allowed"):
        mgr.load(path, {"w": torch.zeros(3)})
    assert not (tmp_path / "pwned").exists()


# --- export and CLI -----------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_export_matches_logits(tiny_model_dir: Path, tmp_path: Path, tied: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_hpc.checkpoint.export import export_hf

    model_dir = tiny_model_dir
    if not tied:
        config = AutoConfig.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
        torch.manual_seed(1)
        model_dir = tmp_path / "untied"
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
        shutil.copy(tiny_model_dir / "tokenizer.json", model_dir)
    model, optim = _model_and_optim(model_dir, steps=2)  # trained: differs from model_dir's weights
    mgr = CheckpointManager(tmp_path / "run" / "checkpoints", 2, None, async_save=False)
    path = mgr.save(7, _state(model, optim), {"model_dir": str(model_dir)})
    out = export_hf(path, tmp_path / "hf")
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(2, 60, (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (exported(ids).logits - model(ids).logits).abs().max().item()
    assert diff <= 1e-6


def test_cli_list_and_export(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    from verl_hpc.cli.main import main

    run = tmp_path / "run"
    model, optim = _model_and_optim(tiny_model_dir, steps=1)
    mgr = CheckpointManager(run / "checkpoints", 2, None, async_save=False)
    mgr.save(5, _state(model, optim), {"model_dir": str(tiny_model_dir), "world_sizes": {"actor": 2}})
    (run / "checkpoints" / ".partial-step_00000006-00ff").mkdir()
    assert main(["ckpt", "list", str(run)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:4] == ["STEP", "TIME", "SIZE", "STATUS"]
    assert "committed" in rows[1] and "actor=2" in rows[1] and "partial" in rows[2]
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf") is not None
    capsys.readouterr()
    for argv in (["ckpt", "list", str(tmp_path / "nope")], ["export", str(tmp_path / "nope"), str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "nope" in err
