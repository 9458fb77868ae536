"""`model.param_offload`: the reference and critic weights in host memory between their passes.

Why these tests on a CPU: the saving is a GPU one (tests/gpu/test_param_offload_gpu.py
measures it), but the bookkeeping — host copies, storage swapped in and out, a trained
model's updates copied back, gradients dropped — is the same code whatever the device,
and `on_cpu=True` runs it here with real copies. A config that turns offload on must
also train a CPU run to exactly the numbers of one that does not.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from tests.conftest import run_cli
from verl_hpc.roles.offload import ParamOffload


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    model.register_buffer("scale", torch.full((3,), 2.0))
    return model


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x) * model.get_buffer("scale")


def test_a_frozen_model_sits_in_its_host_copies_and_computes_the_same_in_a_pass() -> None:
    plain, model = _model(), _model().requires_grad_(False)
    offload = ParamOffload(model, torch.device("cpu"), True, on_cpu=True)
    assert offload.active and not offload.trained
    hosts = {name: t.data_ptr() for name, t in offload.host.items()}
    assert set(hosts) == {n for n, _ in model.named_parameters()} | {"scale"}
    assert all(t.data_ptr() == hosts[n] for n, t in [*model.named_parameters(), *model.named_buffers()])
    x = torch.randn(4, 6)
    with offload.resident():  # a separate copy of every tensor, as on the device
        assert all(t.data_ptr() != hosts[n] for n, t in [*model.named_parameters(), *model.named_buffers()])
        out = _forward(model, x)
    assert torch.equal(out, _forward(plain, x))
    assert all(t.data_ptr() == hosts[n] for n, t in [*model.named_parameters(), *model.named_buffers()])
    assert offload.passes == 1


def test_a_trained_model_keeps_every_update_across_offloads_and_drops_its_gradients() -> None:
    plain, model = _model(), _model()
    offload = ParamOffload(model, torch.device("cpu"), True, on_cpu=True)
    assert offload.trained
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (plain, model)]
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 6)
        for net, optimizer, passes in ((plain, optimizers[0], None), (model, optimizers[1], offload)):
            context = passes.resident() if passes is not None else torch.enable_grad()
            with context:
                optimizer.zero_grad(set_to_none=True)
                _forward(net, x).square().mean().backward()
                optimizer.step()
        assert all(p.grad is None for p in model.parameters())  # dropped with the device copy
        for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), name  # the update reached the host copy, bit for bit
            assert b.data_ptr() == offload.host[name].data_ptr()


def test_a_checkpoint_loaded_while_offloaded_is_what_the_next_pass_computes_with() -> None:
    source, model = _model(), _model()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    offload = ParamOffload(model, torch.device("cpu"), True, on_cpu=True)
    model.load_state_dict(source.state_dict())
    x = torch.randn(2, 6)
    with offload.resident():
        assert torch.equal(_forward(model, x), _forward(source, x))


def test_offload_on_a_cpu_device_leaves_the_model_alone() -> None:
    model = _model()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    offload = ParamOffload(model, torch.device("cpu"), True)
    assert not offload.active and not offload.host
    with offload.resident():
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert not ParamOffload.none().active


def _numbers(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing_s/", "memory/", "perf/", "throughput/"))}
            for row in rows]


def ppo_with_and_without_offload(tmp_path: Path, *common: str) -> dict[str, Path]:
    """Two `quickstart_ppo` runs, `plain` and `offload` (ref and critic), their run directories."""
    runs = {}
    for name, extra in (("plain", []), ("offload", ["model.param_offload.ref=true",
                                                     "model.param_offload.critic=true"])):
        runs[name] = tmp_path / name
        proc = run_cli("train", "configs/quickstart_ppo.yaml", "--run-dir", str(runs[name]), *common, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return runs


def test_a_ppo_run_with_ref_and_critic_offload_trains_to_the_numbers_of_one_without(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    runs = ppo_with_and_without_offload(tmp_path, f"model.path={tiny_model_dir}", "trainer.total_steps=4",
                                        "trainer.batch_size=16", "logging.progress=off", "trainer.save_hf_model=false")
    plain, offloaded = _numbers(runs["plain"]), _numbers(runs["offload"])
    assert len(plain) == 4 and "critic/vf_loss" in plain[-1] and "actor/kl" in json.dumps(plain)
    assert offloaded == copy.deepcopy(plain)
