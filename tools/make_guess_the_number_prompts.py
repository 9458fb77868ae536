"""Prompt rows for TextArena's GuessTheNumber whose seeds hide every number equally often.

Why balanced: with as many games of each number, no pair of fixed guesses wins more than its
share (2 of 4 numbers: half the games), and a policy that ignores the hints gains nothing by
leaning towards a number the seeds happen to favour — only reading the hints pays more.

    python tools/make_guess_the_number_prompts.py --per-number 16 \
        --out examples/envs/guess_the_number_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SYSTEM = "Guess the number. Each turn, answer with one digit and nothing else."


def balanced_seeds(low: int, high: int, per_number: int, max_turns: int = 2) -> list[int]:
    """The first seeds, in order, that give each number from `low` to `high` exactly `per_number` games."""
    from verl_hpc.roles.env.sources import TextArenaEnvironment

    game = TextArenaEnvironment("GuessTheNumber-v0", min_number=low, max_number=high, max_turns=max_turns)
    counts = {n: 0 for n in range(low, high + 1)}
    seeds, seed = [], 0
    while any(c < per_number for c in counts.values()):
        game.reset(seed=seed)
        number = int(game.game.state.game_state["game_number"])
        if counts[number] < per_number:
            counts[number] += 1
            seeds.append(seed)
        seed += 1
    return seeds


def prompt_rows(seeds: list[int]) -> list[dict]:
    return [{"prompt": [{"role": "system", "content": SYSTEM}], "data_source": "textarena/GuessTheNumber-v0",
             "reward_model": {"ground_truth": "win"}, "extra_info": {"env_seed": seed}} for seed in seeds]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-number", type=int, default=1)
    parser.add_argument("--max-number", type=int, default=4)
    parser.add_argument("--per-number", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = prompt_rows(balanced_seeds(args.min_number, args.max_number, args.per_number))
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
