"""A ground truth that is not text reaches the reward as the object the file holds, as in verl.

verl's search-R1 layout stores `reward_model.ground_truth` as `{"target": [...]}` and its
`default_compute_score` indexes into it; flattened to JSON text it raised TypeError and
stopped the run. The text form stays in the batch for logs and metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.algo.verl_ref_env import run_beside_verl
from verl_hpc.data.prompts import PromptDataset
from verl_hpc.data.rollout_batch import RolloutBatch
from verl_hpc.roles.reward import RuleReward

SEARCH_ROWS = [
    {"data_source": "searchR1_nq", "prompt": [{"role": "user", "content": "Capital of France?"}],
     "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris", "City of Paris"]}},
     "extra_info": {"split": "train", "index": 0}},
    {"data_source": "searchR1_triviaqa", "prompt": [{"role": "user", "content": "Largest planet?"}],
     "reward_model": {"style": "rule", "ground_truth": {"target": ["Jupiter"]}},
     "extra_info": {"split": "train", "index": 1}},
]
RESPONSES = ["<think>easy</think><answer> paris </answer>", "<answer>Saturn</answer>", "no tags: Jupiter",
             "<answer>the Jupiter</answer>"]
ROW_OF_RESPONSE = [0, 1, 1, 1]


class TextTokenizer:
    """Response ids are indices into RESPONSES: decoding needs no vocabulary."""

    eos_token_id = -1

    def batch_decode(self, rows: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [RESPONSES[row[0]] for row in rows]


def search_r1_batch(tmp_path: Path) -> tuple[PromptDataset, RolloutBatch]:
    path = tmp_path / "search_r1.parquet"
    pq.write_table(pa.Table.from_pylist(SEARCH_ROWS), path)
    dataset = PromptDataset([path], require_answer=True)
    batch = RolloutBatch.from_generation(
        [[1]] * len(RESPONSES), [[i] for i in range(len(RESPONSES))], None, ROW_OF_RESPONSE, ROW_OF_RESPONSE,
        [dataset.ground_truths[i] for i in ROW_OF_RESPONSE], policy_version=0,
        data_source=[dataset.data_sources[i] for i in ROW_OF_RESPONSE],
        extra_info=[dataset.extra_infos[i] for i in ROW_OF_RESPONSE])
    return dataset, batch


def test_a_dict_ground_truth_reaches_verls_signature_whole_and_logs_show_its_text(tmp_path: Path) -> None:
    seen: list[object] = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(ground_truth)
        return float(ground_truth["target"][0].lower() in solution_str.lower())

    dataset, batch = search_r1_batch(tmp_path)
    scores = RuleReward(compute_score, TextTokenizer()).score(batch)
    assert seen == [SEARCH_ROWS[i]["reward_model"]["ground_truth"] for i in ROW_OF_RESPONSE]
    assert scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert dataset.answers[0] == json.dumps({"target": ["Paris", "City of Paris"]})  # the text logs show
    assert json.loads(batch.column("ground_truth").to_pylist()[1]) == {"target": ["Jupiter"]}


def test_numbers_reach_verls_signature_as_numbers_and_ours_as_text(tmp_path: Path) -> None:
    files = []
    for name, rows in (("numbers", [("1+2=", 3)]), ("lists", [("list?", [1, 2])]), ("text", [("text?", "7")])):
        files.append(tmp_path / f"{name}.jsonl")  # one shape per column and file
        files[-1].write_text("".join(json.dumps({"prompt": p, "ground_truth": a}) + "\n" for p, a in rows))
    dataset = PromptDataset(files, require_answer=True)
    assert dataset.answers == ["3", "[1, 2]", "7"] and dataset.ground_truths == [3, [1, 2], "7"]
    batch = RolloutBatch.from_generation([[1]] * 3, [[0]] * 3, None, [0, 1, 2], [0, 1, 2], dataset.ground_truths,
                                         policy_version=0)
    verl_seen: list[object] = []
    ours_seen: list[object] = []

    def verl_score(data_source, solution_str, ground_truth):
        verl_seen.append(ground_truth)
        return 0.0

    def our_score(prompt, response, ground_truth, **_):
        ours_seen.append(ground_truth)
        return 0.0

    RuleReward(verl_score, TextTokenizer()).score(batch)
    RuleReward(our_score, TextTokenizer()).score(batch)
    assert verl_seen == [3, [1, 2], "7"]
    assert ours_seen == ["3", [1, 2], "7"]


VERL_SIDE = """
import json, sys
from pathlib import Path
from tests.data.test_structured_ground_truth import ROW_OF_RESPONSE, RESPONSES, SEARCH_ROWS, TextTokenizer, search_r1_batch
from verl.utils.reward_score import default_compute_score
from verl_hpc.roles.reward import RuleReward
_, batch = search_r1_batch(Path(sys.argv[1]))
ours = RuleReward(default_compute_score, TextTokenizer()).score(batch).tolist()
verl = [float(default_compute_score(SEARCH_ROWS[r]["data_source"], text, SEARCH_ROWS[r]["reward_model"]["ground_truth"],
                                    SEARCH_ROWS[r]["extra_info"])) for text, r in zip(RESPONSES, ROW_OF_RESPONSE)]
print(json.dumps({"ours": ours, "verl": verl}))
"""


def test_verls_default_compute_score_scores_a_search_r1_row_as_verl_does(tmp_path: Path) -> None:
    result = run_beside_verl(["-c", VERL_SIDE, str(tmp_path)], with_project=True)
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["ours"] == numbers["verl"] == [1.0, 0.0, 0.0, 1.0]
