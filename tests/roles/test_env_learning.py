"""TextArena's GuessTheNumber trains the tiny model past every policy that ignores the game's hints.

configs/guess_the_number.yaml: a number from 1 to 4, two guesses, "higher"/"lower" after a miss,
a one-token guess per turn, paid for a win only. A policy that does not read the hints guesses
the same two numbers whatever they say; the best such pair wins the games whose number is one
of them (32 of the example's 64, whose seeds hide each number 16 times). Reading the hint after
an opening 2 wins 48 of them.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from verl_hpc.data.rollout_batch import RolloutBatch

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("textarena") is None,
                                reason="needs TextArena: pip install -e .[envs]")
CONFIG = REPO / "configs" / "guess_the_number.yaml"
STEPS = 200


def game_numbers() -> list[int]:
    """The number each row's game hides: the game seeded by the row's `env_seed`, as the run seeds it."""
    import yaml

    from verl_hpc.roles.env.sources import TextArenaEnvironment

    env_cfg = yaml.safe_load(CONFIG.read_text())["rollout"]["multi_turn"]["environment"]
    rows = [json.loads(line) for line in (REPO / "examples" / "envs" / "guess_the_number_prompts.jsonl").open()]
    game = TextArenaEnvironment(env_cfg["id"], env_cfg["action_wrappers"], **env_cfg["kwargs"])
    numbers = []
    for row in rows:
        game.reset(seed=row["extra_info"]["env_seed"])
        numbers.append(int(game.game.state.game_state["game_number"]))
    return numbers


def best_hint_blind_win_rate(numbers: list[int], low: int, high: int) -> float:
    """The most any policy that ignores the hints wins: its two guesses are fixed, so the best pair's share."""
    pairs = itertools.permutations(range(low, high + 1), 2)
    return max(sum(n in pair for n in numbers) for pair in pairs) / len(numbers)


def test_the_hint_blind_bound_counts_the_best_fixed_pair() -> None:
    assert best_hint_blind_win_rate([1, 2, 2, 3, 4, 4, 4, 1], 1, 4) == 5 / 8  # 4 and 2 (or 4 and 1)
    assert best_hint_blind_win_rate([3, 3], 1, 3) == 1.0


@pytest.mark.slow
def test_guess_the_number_trains_past_every_policy_that_ignores_the_hints(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("train", str(CONFIG), "--run-dir", str(run_dir), f"model.path={tmp_path / 'model'}",
                   f"trainer.total_steps={STEPS}", "data.record_rollouts=true", "trainer.save_hf_model=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    numbers = game_numbers()
    blind = best_hint_blind_win_rate(numbers, 1, 4)
    rows = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS and all(r["env/failures"] == 0 for r in rows)
    first, last = rows[0]["critic/score/mean"], sum(r["critic/score/mean"] for r in rows[-10:]) / 10
    assert first < blind < last - 0.1, (first, blind, last)  # every game is played each step: the same 64 games
    # It wins by reading the hint: after its usual opening, its usual second guess follows what the hint says.
    batch = RolloutBatch.from_ipc((run_dir / "rollouts" / f"step_{STEPS:08d}_rank0000.arrow").read_bytes())
    seconds = second_guesses([json.loads(t)["messages"] for t in batch.column("trajectory").to_pylist()])
    openings: Counter = Counter()
    for (first_guess, _, _), count in seconds.items():
        openings[first_guess] += count
    opening = openings.most_common(1)[0][0]
    higher, lower = (Counter({g: c for (o, h, g), c in seconds.items() if (o, h) == (opening, hint)})
                     for hint in ("higher", "lower"))
    assert higher and lower, seconds
    assert int(higher.most_common(1)[0][0]) > int(opening) > int(lower.most_common(1)[0][0]), seconds


def second_guesses(episodes: list[list[dict]]) -> Counter:
    """(first guess, hint, second guess) of the episodes that got a hint and guessed again."""
    seen: Counter = Counter()
    for messages in episodes:
        turns = [m["content"] for m in messages if m["role"] in ("assistant", "user")]
        if len(turns) >= 3:
            seen[(turns[0], "higher" if "higher" in turns[1] else "lower", turns[2])] += 1
    return seen


def test_second_guesses_are_read_from_each_episodes_messages() -> None:
    episodes = [[{"role": "system", "content": "s"}, {"role": "assistant", "content": "2"},
                 {"role": "user", "content": "The target number is higher."}, {"role": "assistant", "content": "4"}],
                [{"role": "assistant", "content": "2"}]]
    assert second_guesses(episodes) == Counter({("2", "higher", "4"): 1})


def test_the_example_rows_are_the_balanced_seeds_the_tool_writes(tmp_path: Path) -> None:
    """examples/envs/guess_the_number_prompts.jsonl is what tools/make_guess_the_number_prompts.py writes."""
    import subprocess
    import sys

    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_guess_the_number_prompts.py"), "--out", str(out)],
                   check=True, cwd=REPO, capture_output=True)
    assert out.read_text() == (REPO / "examples" / "envs" / "guess_the_number_prompts.jsonl").read_text()
    assert Counter(game_numbers()) == {1: 16, 2: 16, 3: 16, 4: 16}
