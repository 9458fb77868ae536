"""reasoning-gym's procedural tasks as a prompt source, scored by the library's own checker.

Why the whole entry rides in `extra_info`: reasoning-gym's `score_answer(answer, entry)` reads
the entry's metadata (units, tolerances, the puzzle itself), not only its answer string, so
the scorer rebuilds nothing and agrees with the library by construction. The answer is the
text between `<answer>` tags (the library's convention, asked for by its system prompts);
a response without tags is scored as a whole, so a model that answers bare still learns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SOURCE_PREFIX = "reasoning_gym/"
INSTALL_HINT = "pip install reasoning-gym (or the project's `envs` extra: pip install -e '.[envs]')"


def available() -> str | None:
    """None when reasoning-gym imports; else why not, with the fix."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError as err:
        return f"reasoning-gym is not installed ({err}); {INSTALL_HINT}"
    return None


def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def system_prompts() -> dict[str, str]:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return dict(SYSTEM_PROMPTS)


def generate(tasks: list[tuple[str, float, dict[str, Any]]], size: int, seed: int) -> list[dict[str, Any]]:
    """`size` entries ({question, answer, metadata}); several tasks through reasoning-gym's composite."""
    import reasoning_gym

    if len(tasks) == 1:
        name, _, options = tasks[0]
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
    else:
        from reasoning_gym.composite import DatasetSpec

        specs = [DatasetSpec(name=n, weight=w, config=dict(o)) for n, w, o in tasks]
        dataset = reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)
    return [dict(dataset[i]) for i in range(size)]


def prompt_of(question: str, system: str | None, chat: bool) -> str | list[dict[str, str]]:
    if chat:
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return f"{system}\n{question}" if system else question


def rows(entries: list[dict[str, Any]], system: str | None, chat: bool) -> list[dict[str, Any]]:
    """Prompt file rows: the prompt, the answer, `reasoning_gym/<task>` as data_source, the entry as JSON."""
    return [{"prompt": prompt_of(e["question"], system, chat), "ground_truth": str(e["answer"]),
             "data_source": SOURCE_PREFIX + e["metadata"]["source_dataset"],
             "extra_info": json.dumps(e, default=str)} for e in entries]


def write_prompts(out_path: str | Path, tasks: list[tuple[str, float, dict[str, Any]]], size: int, seed: int,
                  system_prompt: str | None = "default", chat: bool = True) -> Path:
    """Write the generated prompts as JSONL (atomically; chat messages keep their shape); returns the path."""
    system = system_prompts()[system_prompt] if system_prompt else None
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows(generate(tasks, size, seed), system, chat):
            f.write(json.dumps(row) + "\n")
    tmp.replace(out)
    return out


def answer_of(response: str) -> str:
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response)
    return tagged if tagged is not None else response.strip()


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | str | None = None) -> float:
    """verl's reward signature: the library's `score_answer` for the entry's own task, in [0, 1]."""
    import reasoning_gym

    entry: Any = extra_info
    for _ in range(2):  # the prompt file holds it as JSON text; the batch's extra_info is JSON of that
        if isinstance(entry, str):
            entry = json.loads(entry)
    if not entry:
        entry = {"answer": ground_truth, "metadata": {"source_dataset": data_source.removeprefix(SOURCE_PREFIX)}}
    name = entry["metadata"].get("source_dataset") or data_source.removeprefix(SOURCE_PREFIX)
    return float(reasoning_gym.get_score_answer_fn(name)(answer_of(solution_str), entry))
