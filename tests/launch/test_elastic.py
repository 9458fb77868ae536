"""Elastic resources: a live resize of a local run, and the request/history protocol."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli
from tests.e2e.test_dist_e2e import REWARD_SPY
from verl_hpc.config import ConfigError, dump_config, load_config
from verl_hpc.runtime.state import resize

STEPS = 8
BOUNDARY = 3
# The reward function of the live test: records who scored what, and asks for the resize while
# scoring step BOUNDARY (the request lands mid-step, so the run acts on it right after that step).
RESIZING_SPY = REWARD_SPY + '''
CALLS = [0]
def resizing_score(prompt, response, ground_truth, **_):
    value = score(prompt=prompt, response=response, ground_truth=ground_truth)
    CALLS[0] += 1
    if CALLS[0] == int(os.environ["RESIZE_AT_CALL"]):
        try:
            marker = os.open(os.environ["SPY_FILE"] + ".asked", os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return value  # the new world's workers count again from 0: ask once
        os.close(marker)
        from verl_hpc.launch.elastic import update_resource
        update_resource(os.environ["RUN_DIR"], "reward", device_ids=[3, 4])
    return value
'''


def _split_run_dir(tmp_path: Path, reward_ids: list[int]) -> Path:
    """A run directory holding a split config (no training), for the protocol tests."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(REPO / "configs/quickstart_split.yaml",
                      [f"resources.reward={{device_type: cpu, device_ids: {reward_ids}, strategy: data_parallel}}"])
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir


def test_request_is_validated_merged_and_applied_with_history(tmp_path: Path) -> None:
    from verl_hpc.launch.handle import RunHandle

    run_dir = _split_run_dir(tmp_path, [3])
    original = (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="resources.reward.device_idz"):
        resize.request_resize(run_dir, ["reward.device_idz=[3,4]"])
    with pytest.raises(ConfigError, match="changes nothing"):
        resize.request_resize(run_dir, ["reward.device_ids=[3]"])
    with pytest.raises(ConfigError, match="rollout.device_ids"):  # overlaps the actor's GPUs once on cuda
        resize.request_resize(run_dir, ["rollout.device_type=cuda", "actor.device_type=cuda",
                                        "rollout.device_ids=[0]"])
    assert not resize.pending(run_dir)
    handle = RunHandle(run_dir)
    proc = run_cli("resize", str(run_dir), "reward.device_ids=[3,5]")
    assert proc.returncode == 0 and "resize recorded" in proc.stdout, proc.stderr
    handle.update_resource("reward", device_ids=[3, 4], strategy="data_parallel")  # merged: the last wins
    request = yaml.safe_load((run_dir / resize.REQUEST_FILE).read_text())
    assert request["overrides"] == ["resources.reward.device_ids=[3, 4]", "resources.reward.strategy=data_parallel"]
    resize.accept(run_dir, 7)
    assert not resize.pending(run_dir) and resize.accepted(run_dir)["accepted_after_step"] == 7
    cfg = resize.apply_accepted(run_dir)
    assert cfg.resources.reward.device_ids == [3, 4]
    assert load_config(run_dir / "config.yaml").resources.reward.device_ids == [3, 4]
    assert (run_dir / resize.ORIGINAL_FILE).read_text() == original  # the first config is kept
    [entry] = handle.history()
    assert entry["after_step"] == 7 and entry["world_size"] == {"before": 4, "after": 5}
    assert entry["before"]["reward"]["device_ids"] == [3] and entry["after"]["reward"]["device_ids"] == [3, 4]
    assert resize.accepted(run_dir) is None
    status = run_cli("status", str(run_dir))  # a run directory: per-role devices and the history
    assert status.returncode == 0, status.stderr
    assert "reward (reward): 2 task(s), cpu device_ids [3, 4], strategy data_parallel" in status.stdout
    assert "resized after step 7: resources.reward.device_ids=[3, 4]" in status.stdout


def test_one_process_run_refuses_a_live_resize(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(load_config(REPO / "configs/quickstart.yaml")))
    proc = run_cli("resize", str(run_dir), "rollout.device_ids=[1]")
    assert proc.returncode == 2 and "one process" in proc.stderr, proc.stderr
    assert not resize.pending(run_dir)


@pytest.mark.slow
def test_live_resize_of_the_reward_role_scores_every_rollout_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Reward 1 -> 2 workers while training: a checkpointed restart at a step boundary."""
    from verl_hpc.launch.handle import RunHandle
    from verl_hpc.metrics import read_jsonl_metrics

    (tmp_path / "spy.py").write_text(RESIZING_SPY)
    spy, run_dir = tmp_path / "spy.tsv", tmp_path / "run"
    run = RunHandle.start(REPO / "configs/quickstart_split.yaml", run_dir, [
        f"model.path={tiny_model_dir}", f"trainer.total_steps={STEPS}", "trainer.save_hf_model=false",
        f"reward.function={tmp_path / 'spy.py'}:resizing_score",
        "resources.reward={device_type: cpu, device_ids: [3], strategy: data_parallel}"],
        env={"TOKENIZERS_PARALLELISM": "false", "SPY_FILE": str(spy), "RUN_DIR": str(run_dir),
             "RESIZE_AT_CALL": str((BOUNDARY - 1) * 128 + 1)})
    code = run.wait(timeout=600)
    launcher_log = (run_dir / "logs" / "launcher.out").read_text()
    assert code == 0, launcher_log[-3000:]

    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # continuous: no gap, no repeat
    [entry] = resize.history(run_dir)
    boundary = entry["after_step"]
    assert boundary == BOUNDARY  # the step that saw the request finished first, in the old world
    assert load_config(run_dir / "config.yaml").resources.reward.device_ids == [3, 4]
    lines = [line.split("\t") for line in spy.read_text().splitlines()]
    assert len(lines) == STEPS * 128  # every rollout scored exactly once, across the restart
    for step, row in enumerate(rows, start=1):
        part = lines[(step - 1) * 128:step * 128]
        assert row["critic/score/mean"] == pytest.approx(sum(float(v) for _, v in part) / 128)
        assert len({pid for pid, _ in part}) == (1 if step <= boundary else 2)  # the new worker joined
    assert f"resized after step {boundary}" in launcher_log


def test_status_shows_each_cuda_roles_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_hpc.launch.elastic import device_report

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(REPO / "configs/quickstart_split.yaml", [
        "resources.actor={device_type: cuda, device_ids: [0], strategy: fsdp}",
        "resources.rollout={device_type: cuda, device_ids: [1], strategy: hf}"])
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    gib = 2**30
    usage = {"available": True, "reason": None, "devices": [
        {"index": i, "name": "H100", "uuid": f"GPU-{i}", "memory_used_bytes": i * gib,
         "memory_total_bytes": 80 * gib, "utilization_percent": 10 * i} for i in range(8)]}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # config ids are positions in it, as the launcher maps them
    text = "\n".join(device_report(run_dir, usage))
    assert "trainer (actor, ref): 1 task(s), cuda device_ids [0], strategy fsdp" in text
    assert "device 0 = GPU 4 (H100): 4.0 of 80.0 GiB used, 40% busy" in text
    assert "device 1 = GPU 5 (H100): 5.0 of 80.0 GiB used, 50% busy" in text
    assert "reward (reward): 1 task(s), cpu device_ids [3]" in text  # CPU roles: no GPU lines
    unknown = "\n".join(device_report(run_dir, {"available": False, "reason": "no driver", "devices": []}))
    assert "GPU use unknown: no driver" in unknown


def test_status_shows_the_environment_workers(tmp_path: Path) -> None:
    from verl_hpc.launch.elastic import device_report

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(load_config(REPO / "configs/slurm_env_box.yaml")))
    text = "\n".join(device_report(run_dir))
    assert "env (environment workers): 2 process(es), 1 CPU(s) each, 1 node(s) of their own under Slurm" in text
