"""`verl-hpc verl`: three command lines in verl's own form (GRPO, PPO with a critic, DAPO) run on
the tiny model and the quickstart's addition task in verl's Parquet layout, and learn; their
`--print-config` output validates and states the sequence counts.

The reward is a verl `compute_score` file named with verl's `custom_reward_function.*` keys:
the task's answer with partial credit (the share of the response's characters that are the
sum's digit), which the tiny model learns within a few dozen steps at lr 1e-2 (measured:
GRPO 0.03 -> 0.15 in 22 steps, PPO with its untrained critic 0.01 -> 0.13 in 19; DAPO's
line adds the overlong buffer, which it learns first: -0.43 -> 0.1). The exact-answer
reward (examples/verl_arithmetic/reward.py) needs the quickstart's hundreds of steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from verl_hpc.cli.main import main
from verl_hpc.config import load_config
from verl_hpc.metrics import read_jsonl_metrics

STEPS = 30
LR = "1e-2"
DIGIT_SHARE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.strip()
    return sum(c == str(ground_truth) for c in text) / max(len(text), 1)
'''
N = {"grpo": 8, "ppo": 4, "dapo": 8}
LINES = {
    "grpo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
             "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
             "algorithm.use_kl_in_reward=False"],
    "ppo": ["algorithm.adv_estimator=gae", "critic.model.path={model}", f"critic.optim.lr={LR}",
            "critic.cliprange_value=0.5", "critic.model.enable_gradient_checkpointing=False",
            "critic.ppo_micro_batch_size_per_gpu=64", "algorithm.use_kl_in_reward=False",
            "actor_rollout_ref.actor.use_kl_loss=False", "trainer.critic_warmup=0"],
    "dapo": ["algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
             "algorithm.filter_groups.max_num_gen_batches=10", "data.gen_batch_size=48",
             "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
             "actor_rollout_ref.actor.loss_agg_mode=token-mean", "reward_model.reward_manager=dapo",
             "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
             "+reward_model.reward_kwargs.overlong_buffer_cfg.len=1",
             "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
             "+reward_model.reward_kwargs.max_resp_len=4"],
}


@pytest.fixture(scope="module")
def verl_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The addition task in verl's layout (examples/verl_arithmetic) and the reward file beside it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_data", REPO / "examples" / "verl_arithmetic" / "make_data.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    out = tmp_path_factory.mktemp("verl_data")
    module.write(out)
    (out / "digit_share.py").write_text(DIGIT_SHARE)
    return out


def command_line(name: str, model: Path, data: Path, run_dir: Path) -> list[str]:
    """verl's overrides as a verl run script would give them to main_ppo."""
    common = [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
              "data.train_batch_size=16", "data.max_prompt_length=16", "data.max_response_length=4",
              f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
              "actor_rollout_ref.model.use_remove_padding=False", f"actor_rollout_ref.actor.optim.lr={LR}",
              "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.entropy_coeff=0.01",
              "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.rollout.name=hf",
              f"actor_rollout_ref.rollout.n={N[name]}", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
              "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
              f"trainer.total_training_steps={STEPS}", "trainer.logger=['console']", "trainer.project_name=verl_hpc",
              f"trainer.experiment_name={name}", "trainer.val_before_train=False", "trainer.test_freq=-1",
              "trainer.save_freq=-1", f"trainer.default_local_dir={run_dir}",
              f"custom_reward_function.path={data / 'digit_share.py'}",
              "custom_reward_function.name=compute_score"]
    return common + [item.format(model=model, LR=LR) for item in LINES[name]]


@pytest.mark.parametrize("name", sorted(LINES))
def test_print_config_validates_and_states_the_sequence_counts(name: str, tmp_path: Path, tiny_model_dir: Path,
                                                               verl_data: Path, capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process (`main` is what `verl-hpc` runs): printing starts no training, so no process of its own."""
    monkeypatch.chdir(REPO)
    assert main(["verl", "--print-config", *command_line(name, tiny_model_dir, verl_data, tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    sequences = 16 * N[name]
    assert (f"# trainer.batch_size: {sequences} sequences = data.train_batch_size 16 prompts x "
            f"actor_rollout_ref.rollout.n {N[name]}") in printed
    assert f"# algorithm.mini_batch_size: {sequences} sequences" in printed
    assert "#   actor_rollout_ref.actor.fsdp_config.param_offload=False: engine speed or memory only" in printed
    path = tmp_path / f"{name}.yaml"
    path.write_text(printed)
    cfg = load_config(path)  # the printed YAML is a verl-hpc config as it stands, run from REPO
    assert cfg.trainer.batch_size == sequences and cfg.trainer.total_steps == STEPS
    assert cfg.algorithm.estimator.name == {"grpo": "grpo", "ppo": "gae", "dapo": "grpo"}[name]
    assert cfg.algorithm.filter_groups.enable == (name == "dapo") and cfg.algorithm.needs_critic == (name == "ppo")


def test_a_key_that_maps_to_nothing_is_refused_in_one_line(tmp_path: Path, tiny_model_dir: Path,
                                                           verl_data: Path) -> None:
    proc = run_cli("verl", *command_line("grpo", tiny_model_dir, verl_data, tmp_path / "run"),
                   "actor_rollout_ref.actor.no_such_knob=1")
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert proc.stderr.strip() == ("verl-hpc: error: actor_rollout_ref.actor.no_such_knob: is a verl key that maps to "
                                   "nothing in verl-hpc (hint: remove it, or see docs/verl.md for the keys verl-hpc "
                                   "takes)")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LINES))
def test_verls_command_line_runs_here_and_learns(name: str, tmp_path: Path, tiny_model_dir: Path,
                                                  verl_data: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("verl", *command_line(name, tiny_model_dir, verl_data, run_dir), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verl-hpc: ignored actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64" in proc.stderr
    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert len(rows) == STEPS
    score = [r["critic/score/mean"] for r in rows]
    first, last = sum(score[:5]) / 5, sum(score[-5:]) / 5
    assert last > first + 0.07 and last > 2 * first, " ".join(f"{x:.3f}" for x in score)


def test_submit_dry_run_prints_the_one_slurm_job(tmp_path: Path, tiny_model_dir: Path, verl_data: Path) -> None:
    proc = run_cli("verl", "--submit", "--dry-run", *command_line("grpo", tiny_model_dir, verl_data, tmp_path / "run"),
                   "--set", "slurm.time=00:30:00")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "#SBATCH --job-name=grpo" in proc.stdout and "#SBATCH --time=00:30:00" in proc.stdout
    assert str(tmp_path / "run") in proc.stdout and not (tmp_path / "run").exists()  # a dry run creates nothing
