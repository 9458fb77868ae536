"""TRL's GRPOTrainer, driven block by block from bench/step.py (runs in bench/.venv-trl).

Not part of the project and never imported by it: bench/step.py starts this file with
the TRL venv's python, passes the settings as a JSON file, and alternates with
the project through stdin/stdout: this process prints `ready`, then for every `go N`
line it runs N optimizer steps and prints their durations as one JSON line. While it
waits for the next `go` it uses no CPU, so the project's blocks run undisturbed.

A step is timed from `on_step_begin` to `on_step_end`: generation, reward, loss,
backward and AdamW — the same span bench/step.py times for the project.
"""

from __future__ import annotations

import json
import re
import sys
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def _answer_reward(completions: list[str], ground_truth: list[str], **_: object) -> list[float]:
    """Same rule as verl_hpc.data.tasks.arithmetic.score: first integer equals the answer."""
    out = []
    for text, answer in zip(completions, ground_truth, strict=True):
        match = re.search(r"-?\d+", text)
        out.append(1.0 if match and match.group(0) == answer else 0.0)
    return out


class _BlockDriver(TrainerCallback):
    """Pause before each block of steps until the parent says `go N`; report the block's times."""

    def __init__(self) -> None:
        self.remaining = 0
        self.times: list[float] = []
        self.start = 0.0

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        print("ready", flush=True)

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if self.remaining == 0:
            line = sys.stdin.readline().split()
            if not line or line[0] != "go":
                sys.exit(0)
            self.remaining, self.times = int(line[1]), []
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.times.append(time.perf_counter() - self.start)
        self.remaining -= 1
        if self.remaining == 0:
            print(json.dumps({"step_s": self.times}), flush=True)


def main(settings: dict) -> None:
    torch.set_num_threads(settings["threads"])
    torch.manual_seed(settings["seed"])
    tokenizer = AutoTokenizer.from_pretrained(settings["model_dir"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(settings["model_dir"], dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p, "ground_truth": a}
                              for p, a in zip(settings["prompts"], settings["answers"], strict=True)])
    config = GRPOConfig(
        output_dir=settings["output_dir"], per_device_train_batch_size=settings["batch_size"],
        num_generations=settings["n"], max_completion_length=settings["max_new_tokens"],
        gradient_accumulation_steps=1, num_iterations=1, learning_rate=settings["lr"], beta=0.0,
        temperature=1.0, max_grad_norm=1.0, max_steps=settings["max_steps"], use_cpu=True,
        logging_steps=10**6, save_strategy="no", report_to=[], disable_tqdm=True, seed=settings["seed"],
        dataloader_num_workers=0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, gradient_checkpointing=False, bf16=False, fp16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=_answer_reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[_BlockDriver()])
    trainer.train()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
