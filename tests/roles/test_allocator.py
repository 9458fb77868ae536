"""ResourceAllocator: OOM retries at half the micro-batch, exact by gradient accumulation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runtime.test_runtime_embedded import quick_dict
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.roles.allocator import INJECT_ENV, OutOfMemoryAtFloor, ResourceAllocator, parse_injection
from verl_hpc.runtime.state.run_dir import ALLOW_ENV

VOLATILE = ("timing_s/", "perf/", "memory/", "resource/")


def test_halves_down_to_the_floor_then_fails_with_the_numbers() -> None:
    allocator = ResourceAllocator("cpu", floor=4)
    tried: list[int] = []

    def work(size: int) -> int:
        tried.append(size)
        if size > 8:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return size

    assert allocator.run("train", 32, work) == 8 and tried == [32, 16, 8]
    assert allocator.run("train", 32, work) == 8 and tried[-1] == 8  # the smaller size is kept
    assert allocator.metrics()["resource/degrade_events"] == 2.0
    assert allocator.metrics()["resource/micro_batch_size/train"] == 8.0
    probe = allocator.probe()
    assert 0 < probe["memory/free_gb"] <= probe["memory/total_gb"]
    with pytest.raises(OutOfMemoryAtFloor, match=r"micro-batch 4; [\d.]+ GiB free of [\d.]+ GiB on cpu; "
                                                 r"trainer.min_micro_batch_size=4 is the floor"):
        allocator.run("generate", 16, lambda size: work(size * 100))
    off = ResourceAllocator("cpu", floor=1, enabled=False)
    with pytest.raises(OutOfMemoryAtFloor, match="retries are off"):
        off.run("train", 8, lambda size: work(64))


def test_injection_hook_parses_phase_and_size() -> None:
    assert parse_injection("train:64") == ("train", 64)
    assert parse_injection("16") == (None, 16)
    assert parse_injection("") == (None, None)
    with pytest.raises(ValueError, match="PHASE:N"):
        parse_injection("train:lots")


def _train(run_dir: Path, model_dir: Path) -> list[dict[str, float]]:
    from verl_hpc import HybridTrainer

    data = quick_dict(model_dir, steps=4)
    data["trainer"]["save_hf_model"] = False
    HybridTrainer(config=data, run_dir=run_dir).train()
    return read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")


@pytest.mark.slow
def test_injected_oom_is_retried_smaller_and_matches_the_undisturbed_run(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    baseline = _train(tmp_path / "baseline", tiny_model_dir)
    monkeypatch.setenv(INJECT_ENV, "train:32")  # the whole 32-row batch "does not fit"; 16 does
    degraded = _train(tmp_path / "degraded", tiny_model_dir)
    assert [r["step"] for r in degraded] == [1, 2, 3, 4]
    assert degraded[0]["resource/degrade_events"] == 1.0 and degraded[-1]["resource/degrade_events"] == 1.0
    assert all(r["resource/micro_batch_size/train"] == 16.0 for r in degraded)
    assert "resource/degrade_events" in baseline[0] and baseline[-1]["resource/degrade_events"] == 0.0
    compared = 0
    for base, deg in zip(baseline, degraded, strict=True):
        for key, value in base.items():
            if key.startswith(VOLATILE):
                continue
            assert deg[key] == pytest.approx(value, abs=1e-5, rel=1e-5), (base["step"], key)
            compared += 1
    assert compared >= 4 * 10


@pytest.mark.slow
def test_generation_oom_is_retried_in_smaller_chunks(tmp_path: Path, tiny_model_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_hpc import HybridTrainer

    monkeypatch.setenv(INJECT_ENV, "generate:32")
    data = quick_dict(tiny_model_dir, steps=2)
    data["trainer"]["save_hf_model"] = False
    result = HybridTrainer(config=data, run_dir=tmp_path / "run").train()
    assert result.steps == 2
    assert result.last_metrics["resource/micro_batch_size/generate"] == 16.0
    assert result.last_metrics["resource/degrade_events"] == 1.0


@pytest.mark.slow
def test_floor_that_does_not_fit_fails_the_run_with_the_numbers(tmp_path: Path, tiny_model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_hpc import HybridTrainer

    monkeypatch.setenv(INJECT_ENV, "train:1")
    data = quick_dict(tiny_model_dir, steps=1)
    data["trainer"]["min_micro_batch_size"] = 8
    with pytest.raises(OutOfMemoryAtFloor, match=r"train ran out of memory at micro-batch 8; .* GiB free"):
        HybridTrainer(config=data, run_dir=tmp_path / "run").train()


@pytest.mark.slow
def test_learned_micro_batch_survives_a_restart_on_the_same_resources(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OOM learned before a preemption is not paid again after it: the size is checkpointed."""
    from verl_hpc import HybridTrainer

    data = quick_dict(tiny_model_dir, steps=2)
    data["trainer"]["save_hf_model"] = False
    monkeypatch.setenv(INJECT_ENV, "train:32")
    HybridTrainer(config=data, run_dir=tmp_path / "run").train()
    monkeypatch.delenv(INJECT_ENV)  # after the restart 32 rows would fit: only the checkpoint says 16
    data["trainer"]["total_steps"] = 4
    monkeypatch.setenv(ALLOW_ENV, "1")  # a longer run of the same training: an accepted config change
    HybridTrainer(config=data, run_dir=tmp_path / "run").train()
    rows = read_jsonl_metrics(tmp_path / "run" / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["resource/micro_batch_size/train"] for r in rows] == [16.0] * 4
    assert [r["resource/degrade_events"] for r in rows] == [1.0] * 4  # one event, counted once across the restart
