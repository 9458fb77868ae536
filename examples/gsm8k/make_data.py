"""A small GSM8K-style Parquet in verl's layout (examples/data_preprocess/gsm8k.py), problems written here.

Why our own problems: there is no data download here. The columns are verl's, so the same
file trains in verl and in verl-hpc: `data_source`, `prompt` (chat messages), `ability`,
`reward_model: {style, ground_truth}`, `extra_info: {split, index, answer, question}`.

Why two levels: GSM8K's multi-step problems are beyond what SmolLM2-135M learns on a laptop
CPU in minutes (two steps of them end at score 0), so the worked example
(configs/smollm2_gsm8k.yaml) trains on one-step problems (`--steps 1`, the default) whose
prompt opens with two solved ones in GSM8K's answer format (`a + b = c. #### c`, as earlier
chat turns: few-shot, as GSM8K is evaluated). Measured on SmolLM2-135M-Instruct: greedy, it
answers 78% of the held-out ones right before training, but sampled at temperature 1, as
GRPO trains, about one in eight: room to learn that the score shows (docs/data.md).
`--steps 2` writes the two-step problems with verl's step-by-step instruction.

`--tool-shots N` (for configs/smollm2_gsm8k_tools.yaml) solves each of the N earlier problems with
the calculator instead: the assistant's call, the tool's reply, then the answer. Why six by
default there: SmolLM2-135M-Instruct copies the hermes call from examples in the context, not from
the tools' description alone; measured at temperature 1, it opens 0 of 32 episodes with a call
after two such examples, 9 after four (some malformed), 23 after six.

    .venv/bin/python examples/gsm8k/make_data.py [OUT_DIR] [--count N] [--steps 1|2] [--tool-shots N] [--seed S]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

STEP_BY_STEP = "Let's think step by step and output the final answer after \"####\"."  # verl's gsm8k.py
SHOTS = 2  # solved problems before each one-step question
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils"]


def make_problems(count: int, seed: int = 0, steps: int = 2) -> list[tuple[str, str, int]]:
    """(question, worked answer ending in '#### N', N): one- or two-step word problems like GSM8K's."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        have, more, gave = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 4)
        if steps == 1:
            question = f"{name} has {have} {item} and buys {more} more. How many {item} does {name} have now?"
            total = have + more
            answer = f"{have} + {more} = {total}. #### {total}"
        else:
            total = have + more - gave
            question = (f"{name} has {have} {item}, buys {more} more and gives {gave} away. "
                        f"How many {item} does {name} have now?")
            answer = f"{have} + {more} = {have + more}. {have + more} - {gave} = {total}.\n#### {total}"
        out.append((question, answer, total))
    return out


def solved_with_calculator(question: str, answer: str, total: int) -> list[dict]:
    """A one-step problem solved through the calculator: the call, its reply, the answer."""
    expression = answer.split(" = ")[0]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [{"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": str(total)}, {"role": "assistant", "content": answer}]


def chat(question: str, steps: int, shots: list[tuple[str, str, int]], tools: bool = False) -> list[dict]:
    """The prompt's messages: one-step questions after solved ones (through the calculator when
    `tools`); two-step ones with verl's instruction."""
    if steps == 2:
        return [{"role": "user", "content": f"{question} {STEP_BY_STEP}"}]
    if tools:
        solved = [solved_with_calculator(q, a, n) for q, a, n in shots]
    else:
        solved = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a, _ in shots]
    return [*(m for turn in solved for m in turn), {"role": "user", "content": question}]


def rows(count: int, split: str = "train", steps: int | None = None, seed: int = 0,
         tool_shots: int = 0) -> list[dict]:
    """`steps` None: one-step problems with `tool_shots` (the calculator examples are one-step), else two."""
    if tool_shots and steps == 2:
        raise ValueError("--tool-shots writes one-step problems (each worked example is one calculator call): "
                         "use --steps 1 or leave --steps out")
    steps = steps or (1 if tool_shots else 2)
    shots = tool_shots or SHOTS
    problems = make_problems(count, seed, steps)
    examples = make_problems(shots * count, seed + 1000, steps)  # other problems, solved
    return [{"data_source": "openai/gsm8k",
             "prompt": chat(q, steps, examples[shots * i:shots * (i + 1)], tools=bool(tool_shots)),
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(n)},
             "extra_info": {"split": split, "index": i, "answer": a, "question": q}}
            for i, (q, a, n) in enumerate(problems)]


def write(out_dir: Path, count: int = 16, steps: int | None = None, seed: int = 0, name: str = "train",
          tool_shots: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows(count, name, steps, seed, tool_shots)), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="data/gsm8k")
    parser.add_argument("--count", type=int, default=256, help="training problems (a held-out test.parquet of "
                        "64 more is written beside them)")
    parser.add_argument("--steps", type=int, choices=(1, 2), default=None, help="1 (the default): one-step "
                        "problems, a bare number as the answer (the worked example); 2: two-step, verl's "
                        "step-by-step instruction (not with --tool-shots)")
    parser.add_argument("--tool-shots", type=int, default=0, help="solve this many earlier one-step problems "
                        "with calculator calls in each prompt (configs/smollm2_gsm8k_tools.yaml: 6)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tool_shots and args.steps == 2:
        parser.error("--tool-shots writes one-step problems (each worked example is one calculator call): "
                     "use --steps 1 or leave --steps out")
    args.steps = args.steps or 1
    out = Path(args.out_dir)
    print(write(out, args.count, args.steps, args.seed, tool_shots=args.tool_shots))
    print(write(out, 64, args.steps, args.seed + 1, name="test", tool_shots=args.tool_shots))


if __name__ == "__main__":
    main()
