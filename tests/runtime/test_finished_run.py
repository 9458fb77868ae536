"""When a run is finished, and what a resumed run says it will do.

Finished comes from the run state (the last step's committed checkpoint), not from the
`hf_model/` export, which `trainer.save_hf_model: false` never writes. The whole path, a real
run rerun through the executor and the CLI, is tests/launch/test_executor.py.
"""

from __future__ import annotations

from pathlib import Path

from verl_hpc.runtime.lifecycle import training_line
from verl_hpc.runtime.state.checkpointing import describe_world
from verl_hpc.runtime.state.run_dir import finished_step, total_steps_of


def committed(run_dir: Path, step: int) -> None:
    (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    (run_dir / "checkpoints" / f"step_{step:08d}" / "manifest.json").write_text("{}")


def test_finished_is_the_last_steps_checkpoint_with_or_without_hf_model(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("trainer:\n  total_steps: 4\n")
    assert finished_step(tmp_path) is None
    committed(tmp_path, 2)
    (tmp_path / "checkpoints" / "step_00000004").mkdir()  # being written: no manifest yet
    assert finished_step(tmp_path) is None
    (tmp_path / "checkpoints" / "step_00000004" / "manifest.json").write_text("{}")
    assert finished_step(tmp_path) == 4 and not (tmp_path / "hf_model").exists()
    assert finished_step(tmp_path, total_steps=6) is None  # a config with more steps has work left
    assert total_steps_of("trainer: {total_steps: 7}") == 7 and total_steps_of("not: [a, config") is None


def test_a_resumed_run_says_the_steps_it_has_left() -> None:
    run = Path("runs/x")
    assert training_line("grpo", 0, 6, run) == "training grpo for 6 steps in runs/x"
    assert training_line("grpo", 4, 6, run) == "training grpo for 2 more steps (5-6 of 6) in runs/x"
    assert training_line("ppo", 5, 6, run) == "training ppo for 1 more step (6-6 of 6) in runs/x"
    assert training_line("grpo", 6, 6, run) == "runs/x is at step 6 of 6: no steps left to train"


def test_the_resume_line_names_process_counts_not_a_dict() -> None:
    assert describe_world({"trainer": 1}, {"trainer": 1}) == "saved by 1 trainer process"
    assert describe_world({"trainer": 2, "critic": 1}, {"trainer": 1, "critic": 1}) == \
        "saved by 2 trainer + 1 critic processes, now 1 trainer + 1 critic processes"
    assert describe_world(None, {"trainer": 2}) == "now 2 trainer processes"
