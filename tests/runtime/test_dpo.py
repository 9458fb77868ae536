"""DPO: the loss by hand, training on the built-in preference task, exact resume, and what is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_cli
from tests.e2e.test_train_e2e import scalars, window_means
from verl_hpc.algo.dpo import preference_loss, sequence_logps
from verl_hpc.config import ConfigError, load_config

CONFIG = "configs/dpo_quickstart.yaml"
VOLATILE = ("timing_s/", "perf/", "memory/")  # wall-clock and memory readings, not training state
STEPS = 120
RUN = [f"trainer.total_steps={STEPS}", "trainer.batch_size=16", "checkpoint.interval_steps=4",
       "logging.progress=off", "trainer.torch_threads=1"]

# Two pairs, beta = 0.1. Pair 1: chosen ratio -1.0 - (-1.5) = 0.5, rejected ratio -2.0 - (-1.5) = -0.5,
# h = 1.0; pair 2: chosen ratio -3 - (-2) = -1, rejected ratio -1 - (-2) = 1, h = -2.
POLICY_CHOSEN, POLICY_REJECTED = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
REF_CHOSEN, REF_REJECTED = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])


def test_sigmoid_loss_by_hand() -> None:
    """-log sigma(beta h) = log(1 + e^(-beta h)):
    pair 1: log(1 + e^-0.1) = log(1.9048374180) = 0.6443966601;
    pair 2: log(1 + e^0.2) = log(2.2214027582) = 0.7981388694.
    Rewards beta x ratio: chosen (0.05, -0.1), rejected (-0.05, 0.1); margins (0.1, -0.2): mean -0.05,
    accuracy 1/2. Policy log-probs: chosen mean (-1 - 3) / 2 = -2, rejected (-2 - 1) / 2 = -1.5.
    """
    out = preference_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1)
    assert out.losses.tolist() == pytest.approx([0.6443966601, 0.7981388694], abs=1e-6)
    stats = out.stats()
    assert stats["loss"] == pytest.approx((0.6443966601 + 0.7981388694) / 2, abs=1e-6)
    assert stats["reward_margin"] == pytest.approx(-0.05, abs=1e-6)
    assert stats["reward_accuracy"] == 0.5
    assert stats["chosen_rewards"] == pytest.approx((0.05 - 0.1) / 2, abs=1e-6)
    assert stats["chosen_logps"] == pytest.approx(-2.0, abs=1e-6)
    assert stats["rejected_logps"] == pytest.approx(-1.5, abs=1e-6)


def test_label_smoothing_by_hand() -> None:
    """eps = 0.1 on pair 1 (beta h = 0.1): 0.9 log(1 + e^-0.1) + 0.1 log(1 + e^0.1); since
    log(1 + e^x) - log(1 + e^-x) = x, the second term is 0.6443966601 + 0.1 = 0.7443966601, so
    the loss is 0.9 x 0.6443966601 + 0.1 x 0.7443966601 = 0.6443966601 + 0.01 = 0.6543966601."""
    out = preference_loss(POLICY_CHOSEN[:1], POLICY_REJECTED[:1], REF_CHOSEN[:1], REF_REJECTED[:1], beta=0.1,
                          label_smoothing=0.1)
    assert float(out.losses[0]) == pytest.approx(0.6543966601, abs=1e-6)


def test_sft_term_by_hand() -> None:
    """sft_coef 0.5 x a chosen NLL of 2.0 adds 1.0 to pair 1's 0.6443966601: 1.6443966601."""
    out = preference_loss(POLICY_CHOSEN[:1], POLICY_REJECTED[:1], REF_CHOSEN[:1], REF_REJECTED[:1], beta=0.1,
                          sft_coef=0.5, chosen_nll=torch.tensor([2.0]))
    assert float(out.losses[0]) == pytest.approx(1.6443966601, abs=1e-6)


def test_ipo_loss_by_hand() -> None:
    """(h - 1/(2 beta))^2 with beta = 0.5, target 1: pair 1 (1 - 1)^2 = 0, pair 2 (-2 - 1)^2 = 9; mean 4.5."""
    out = preference_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, loss_type="ipo")
    assert out.losses.tolist() == pytest.approx([0.0, 9.0], abs=1e-6)
    assert out.stats()["loss"] == pytest.approx(4.5, abs=1e-6)


def test_sequence_logps_skip_padding() -> None:
    """Tokens (-0.5, -1.0, pad -7.0): sum -1.5, mean over the 2 real tokens -0.75."""
    logps, mask = torch.tensor([[-0.5, -1.0, -7.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert float(sequence_logps(logps, mask)[0]) == pytest.approx(-1.5, abs=1e-6)
    assert float(sequence_logps(logps, mask, average=True)[0]) == pytest.approx(-0.75, abs=1e-6)


def test_the_preset_fills_dpo_and_config_show_prints_it() -> None:
    cfg = load_config(CONFIG)
    assert cfg.algorithm.dpo is not None and cfg.algorithm.dpo.beta == 0.1
    assert cfg.algorithm.needs_ref and not cfg.algorithm.needs_critic
    ipo = load_config(CONFIG, ["algorithm.dpo.loss_type=ipo"])
    assert ipo.algorithm.dpo is not None and (ipo.algorithm.dpo.loss_type, ipo.algorithm.dpo.beta) == ("ipo", 0.1)


@pytest.mark.parametrize(("override", "field"), [
    ("resources.placement=split", "resources.placement"),
    ("resources.rollout.device_ids=[1]", "resources.rollout"),
    ("resources.critic.device_ids=[1]", "resources.critic"),
    ("reward.function=verl_hpc.data.tasks.arithmetic:score", "reward"),
    ("resources.actor.device_ids=[0,1,2]", "resources.actor.device_ids"),
    ("data.task.name=arithmetic", "data.task.name"),
    ("algorithm.dpo.label_smoothing=0.1", "algorithm.dpo.label_smoothing"),
])
def test_dpo_refuses_what_it_cannot_use(override: str, field: str) -> None:
    extra = ["algorithm.dpo.loss_type=ipo"] if "smoothing" in override else []
    extra += ["resources.actor.strategy=fsdp"] if "actor" in override else []
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [override, *extra])
    assert err.value.path == field, err.value.one_line()


def test_the_rl_loop_refuses_preference_data() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("configs/quickstart.yaml", ["data.task.name=arithmetic_preference"])
    assert err.value.path == "data.task.name"


def test_split_placement_is_refused_in_one_line_by_the_cli(tmp_path: Path) -> None:
    proc = run_cli("train", CONFIG, "resources.placement=split", "--run-dir", str(tmp_path / "refused"))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "resources.placement:" in lines[0] and "colocated" in lines[0], proc.stderr


def greedy_correct(model_dir: Path) -> int:
    """Greedy answers to all 25 prompts a+b= (a, b <= 4) that are exactly the sum, then EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    right = 0
    for a in range(5):
        for b in range(5):
            ids = torch.tensor([tok(f"{a}+{b}=", add_special_tokens=False)["input_ids"]])
            new = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)[0,
                                                                                                        ids.shape[1]:]
            new = new.tolist()
            answer = new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else None
            right += answer is not None and tok.decode(answer, skip_special_tokens=True).strip() == str(a + b)
    return right


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    proc = run_cli("train", CONFIG, "--run-dir", str(run_dir), f"model.path={tiny_model_dir}", *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final dpo/reward_accuracy" in proc.stdout
    return run_dir


@pytest.mark.slow
def test_dpo_learns_the_preference_task(dpo_run: Path, tiny_model_dir: Path) -> None:
    series = scalars(dpo_run)
    for tag in ("dpo/loss", "dpo/reward_margin", "dpo/reward_accuracy", "dpo/chosen_logps", "dpo/rejected_logps",
                "actor/grad_norm", "actor/lr", "timing_s/step"):
        assert len(series[tag]) == STEPS, tag
    first, last = window_means(series["dpo/reward_accuracy"])
    assert last > 0.8 and last > first, (first, last)
    assert window_means(series["dpo/reward_margin"])[1] > 0.5
    # Greedy answers to all 25 prompts (the task has no others): the random model gets none right.
    before, after = greedy_correct(tiny_model_dir), greedy_correct(dpo_run / "hf_model")
    assert after >= before + 15, (before, after)


@pytest.mark.slow
def test_sigkill_then_the_same_command_resumes_exactly(dpo_run: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "interrupted"
    command = [sys.executable, "-m", "verl_hpc", "train", CONFIG, "--run-dir", str(run_dir),
               f"model.path={tiny_model_dir}", *RUN]
    cli = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    marker = run_dir / "checkpoints" / "step_00000008" / "manifest.json"
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline and cli.poll() is None:
        time.sleep(0.05)
    assert cli.poll() is None, "the run ended before it could be killed"
    os.kill(cli.pid, signal.SIGKILL)
    cli.wait()
    assert marker.exists() and not (run_dir / "hf_model").exists()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed" in proc.stdout + proc.stderr
    whole, resumed = scalars(dpo_run), scalars(run_dir)
    compared = [tag for tag in whole if not tag.startswith(VOLATILE)]
    assert "dpo/loss" in compared
    for tag in compared:
        assert resumed[tag] == whole[tag], tag  # bitwise: same numbers, step by step


@pytest.mark.slow
def test_fsdp_on_two_processes_takes_the_same_steps(dpo_run: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    """The colocated launcher with two FSDP actor processes: each takes half the pairs of every step."""
    run_dir = tmp_path / "fsdp"
    proc = run_cli("train", CONFIG, "--run-dir", str(run_dir), f"model.path={tiny_model_dir}", *RUN,
                   "trainer.total_steps=6", "resources.actor.device_ids=[0,1]", "resources.actor.strategy=fsdp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    two, one = scalars(run_dir), scalars(dpo_run)
    for tag in ("dpo/loss", "dpo/reward_margin", "dpo/chosen_logps", "actor/grad_norm"):
        assert two[tag] == pytest.approx(one[tag][:6], rel=1e-4, abs=1e-5), tag
    assert (run_dir / "hf_model" / "config.json").is_file()
