"""The `HybridTrainer` facade's forms, as written (CPU-adapted): `HybridTrainer`, `update_resource`, device_type=cpu.

A cluster user writes `HybridTrainer(actor_model=..., reward_model=fn,
config=load_resource_config("resource_config.yaml"))` and
`trainer.update_resource(component="reward", device_ids=[...], strategy="data_parallel")`,
with `resource_config.yaml` asking for CUDA. Here `resources.device_type=cpu` is the only
change that makes such a config run on this machine; runs are 2 steps of 16 sequences.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from verl_hpc import ConfigError, RunConfig, load_config
from verl_hpc.config.resources import ResourceConfig
from verl_hpc.metrics import read_jsonl_metrics
from verl_hpc.runtime.state import resize
from verl_hpc.utils.resource import HybridTrainer, load_resource_config

RESOURCE_CONFIG = REPO / "configs" / "resource_config.yaml"
CPU = "resources.device_type=cpu"
SHORT = ["trainer.total_steps=2", "trainer.batch_size=16", "logging.progress=off"]


def digit_reward(prompt: str, response: str, ground_truth: str, **_: object) -> float:
    """A module-level reward: importable by name, so worker processes can call it too."""
    return float(response.strip().startswith(str(ground_truth)))


@pytest.fixture(scope="module")
def hd32_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM's CPU attention needs head size >= 32 (configs/quickstart_vllm.yaml)."""
    from verl_hpc.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-hd32", preset="tiny-hd32", seed=0)


def _cuda_run_config(tmp_path: Path) -> Path:
    """The quickstart with the shipped CUDA resources and GPU-only options, as a cluster user writes it."""
    data = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    data["resources"] = yaml.safe_load(RESOURCE_CONFIG.read_text())
    data["resources"]["rollout"]["vllm_args"]["enable_sleep_mode"] = True
    data["model"].update(dtype="bfloat16", mixed_precision="bfloat16")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _one_process_resources(tmp_path: Path) -> Path:
    path = tmp_path / "resource_config.yaml"
    path.write_text("actor:   {device_type: cuda, device_ids: [0], strategy: hf}\n"
                    "rollout: {device_type: cuda, device_ids: [0], strategy: hf}\n"
                    "comm_backend: nccl\n")
    return path


# ---- configuration only -------------------------------------------------------------------

def test_packaged_defaults_are_the_quickstart() -> None:
    from verl_hpc.config.defaults import QUICKSTART

    assert yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text()) == QUICKSTART


def test_device_type_cpu_runs_a_cuda_config_on_cpu(tmp_path: Path) -> None:
    path = _cuda_run_config(tmp_path)
    cuda = load_config(path)
    assert cuda.resources.resolved_backend() == "nccl" and cuda.resources.actor.device_type == "cuda"
    cfg = load_config(path, overrides=[CPU])
    res = cfg.resources
    assert res.device_type == "cpu"
    for name in ("actor", "reward", "rollout"):
        role, before = res.role(name), cuda.resources.role(name)
        assert role.device_type == "cpu" and role.device_ids == before.device_ids and role.strategy == before.strategy
    assert res.critic is None and res.ref is None  # roles that were not set stay unset
    assert res.comm_backend == "auto" and res.resolved_backend() == "gloo"
    assert res.rollout.vllm_args.enable_sleep_mode is False and res.rollout.vllm_args.gpu_memory_utilization == 0.85
    assert cfg.model.dtype == "float32" and cfg.model.mixed_precision == "auto"  # = fp32 compute on CPU
    assert load_config(data=cfg.model_dump(mode="json", by_alias=True)) == cfg  # config.yaml reloads as is
    # without the switch, a GPU-only option on a CPU role still fails, naming the field
    with pytest.raises(ConfigError, match=r"model\.mixed_precision"):
        load_config(path, overrides=["resources.actor.device_type=cpu"])


def test_device_type_on_the_standalone_resource_config() -> None:
    data = yaml.safe_load(RESOURCE_CONFIG.read_text())
    res = ResourceConfig.model_validate({**data, "device_type": "cpu"})
    assert {res.role(n).device_type for n in ("actor", "reward", "rollout")} == {"cpu"}
    assert res.resolved_backend() == "gloo"
    loaded = load_resource_config(RESOURCE_CONFIG)
    loaded.device_type = "cpu"  # assignment re-validates: the same switch on a loaded object
    assert loaded.actor.device_type == "cpu" and loaded.resolved_backend() == "gloo"


def test_a_resource_config_is_completed_by_the_quickstart(tiny_model_dir: Path) -> None:
    trainer = HybridTrainer(actor_model=tiny_model_dir, reward_model=digit_reward,
                            config=load_resource_config(RESOURCE_CONFIG), overrides=[CPU])
    cfg, quick = trainer.config, load_config(REPO / "configs" / "quickstart.yaml")
    assert cfg.model.path == str(tiny_model_dir) and cfg.model.init_preset is None
    assert cfg.reward.function == f"{__name__}:digit_reward"
    assert cfg.algorithm == quick.algorithm and cfg.data == quick.data and cfg.trainer == quick.trainer
    assert cfg.resources.actor.device_ids == [0, 1] and cfg.resources.rollout.strategy == "vllm"
    # the standalone file given as a path, or as a dict, is read the same way
    for form in (RESOURCE_CONFIG, yaml.safe_load(RESOURCE_CONFIG.read_text())):
        assert HybridTrainer(actor_model=tiny_model_dir, reward_model=digit_reward, config=form,
                             overrides=[CPU]).config == cfg


def test_config_forms_agree(tiny_model_dir: Path) -> None:
    path = REPO / "configs" / "quickstart.yaml"
    overrides = [f"model.path={tiny_model_dir}", "~model.init_preset", *SHORT]
    by_path = HybridTrainer(config=path, overrides=overrides).config
    as_dict = yaml.safe_load(path.read_text())
    assert HybridTrainer(config=as_dict, overrides=overrides).config == by_path
    assert HybridTrainer(config=load_config(path), overrides=overrides).config == by_path
    assert isinstance(by_path, RunConfig) and by_path.trainer.total_steps == 2
    with pytest.raises(ConfigError, match=r"quickstart\.yaml: trainer\.total_step: unknown key"):
        HybridTrainer(config=path, overrides=["trainer.total_step=2"])
    with pytest.raises(ConfigError, match="config"):
        HybridTrainer(config=42)  # type: ignore[arg-type]


def test_reward_and_actor_forms(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    resources = load_resource_config(_one_process_resources(tmp_path))
    spec = "verl_hpc.data.tasks.arithmetic:score"
    cfg = HybridTrainer(actor_model=tiny_model_dir, reward_model=spec, config=resources, overrides=[CPU]).config
    assert cfg.reward.function == spec and cfg.reward.model_path is None
    cfg = HybridTrainer(actor_model=tiny_model_dir, reward_model=tiny_model_dir, config=resources,
                        overrides=[CPU]).config
    assert cfg.reward.model_path == str(tiny_model_dir) and cfg.reward.function is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # the tokenizer: its name_or_path
    assert HybridTrainer(actor_model=model, config=resources, overrides=[CPU]).config.model.path == str(tiny_model_dir)
    bad = [({"reward_model": "not-a-spec"}, "reward_model"), ({"reward_model": model}, "reward_model.*save_pretrained"),
           ({"reward_model": 3}, "reward_model.*not callable"), ({"actor_model": tmp_path}, "actor_model.*config.json"),
           ({"actor_model": Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                          num_hidden_layers=1, num_attention_heads=2,
                                                          num_key_value_heads=1))}, "actor_model.*tokenizer"), ({"actor_model": torch.zeros(1)}, "actor_model")]
    for kwargs, match in bad:
        with pytest.raises(ConfigError, match=match):
            HybridTrainer(config=resources, overrides=[CPU], **kwargs)


def test_objects_become_config_for_worker_processes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Several processes: the model object is saved with its tokenizer, the reward becomes its import spec."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_hpc.api_objects import launch_config

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = HybridTrainer(actor_model=model, reward_model=digit_reward, config=load_resource_config(RESOURCE_CONFIG),
                            run_dir=tmp_path / "run", overrides=[CPU])
    (tmp_path / "run").mkdir()
    cfg, actor, reward, paths = launch_config(trainer.config, model, digit_reward, trainer.run_dir, save=True)
    init = (tmp_path / "run" / "init_model").absolute()
    assert actor is None and reward is None  # only the config reaches the workers
    assert cfg.model.path == str(init) and cfg.model.init_preset is None
    assert cfg.reward.function == f"{__name__}:digit_reward" and str(Path(__file__).parent) in paths
    saved = AutoModelForCausalLM.from_pretrained(init)
    for (name, a), (_, b) in zip(model.state_dict().items(), saved.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert (init / "tokenizer_config.json").is_file()


def test_a_local_reward_function_cannot_reach_workers(tmp_path: Path, tiny_model_dir: Path) -> None:
    def local_reward(prompt: str, response: str, ground_truth: str, **_: object) -> float:
        return 0.0

    with pytest.raises(ConfigError, match=r"^reward_model: 'test_a_local.*local_reward' cannot be imported.*hint"):
        HybridTrainer(actor_model=tiny_model_dir, reward_model=local_reward,
                      config=load_resource_config(RESOURCE_CONFIG), overrides=[CPU])
    # in one process the object is called as it is
    HybridTrainer(actor_model=tiny_model_dir, reward_model=local_reward,
                  config=load_resource_config(_one_process_resources(tmp_path)), overrides=[CPU])


def test_update_resource_before_train_changes_the_trainers_config(tiny_model_dir: Path) -> None:
    trainer = HybridTrainer(actor_model=tiny_model_dir, reward_model=digit_reward,
                            config=load_resource_config(RESOURCE_CONFIG), overrides=[CPU])
    assert trainer.update_resource(component="reward", device_ids=[4, 5], strategy="data_parallel") is None
    reward = trainer.config.resources.reward
    assert reward.device_ids == [4, 5] and reward.strategy == "data_parallel" and reward.device_type == "cpu"
    with pytest.raises(ConfigError, match=r"resources\.reward\.strategy: 'vllm' is not valid"):
        trainer.update_resource(component="reward", strategy="vllm")
    with pytest.raises(ConfigError, match=r"resources\.judge"):
        trainer.update_resource(component="judge", device_ids=[1])
    assert trainer.config.resources.reward.device_ids == [4, 5]  # a refused change leaves it as it was


# ---- runs in this process -----------------------------------------------------------------

def test_facade_form_in_one_process_trains_the_given_objects(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    calls: list[str] = []

    def reward(prompt: str, response: str, ground_truth: str, **_: object) -> float:
        calls.append(prompt)
        return float(response.strip().startswith(str(ground_truth)))

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = HybridTrainer(actor_model=model, reward_model=reward, run_dir=tmp_path / "run",
                            config=load_resource_config(_one_process_resources(tmp_path)), overrides=[CPU, *SHORT])
    result = trainer.train()
    assert result.steps == 2 and len(calls) == 2 * 16
    assert [r["step"] for r in read_jsonl_metrics(result.run_dir / "tensorboard" / "metrics.jsonl")] == [1, 2]
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # the object was trained
    with pytest.raises(ConfigError, match="one process"):  # after a run: a resize request to the run dir
        trainer.update_resource(component="rollout", device_ids=[1])


@pytest.mark.parametrize("form", ["path", "dict", "RunConfig"])
def test_config_forms_run(tmp_path: Path, tiny_model_dir: Path, form: str) -> None:
    path = REPO / "configs" / "quickstart.yaml"
    config = {"path": path, "dict": yaml.safe_load(path.read_text()), "RunConfig": load_config(path)}[form]
    result = HybridTrainer(config=config, run_dir=tmp_path / "run", reward_model=digit_reward,
                           overrides=[f"model.path={tiny_model_dir}", "~model.init_preset", *SHORT]).train()
    assert result.steps == 2 and (result.hf_model_dir / "config.json").is_file()
    assert load_config(tmp_path / "run" / "config.yaml").reward.function == f"{__name__}:digit_reward"


# ---- runs that start worker processes -----------------------------------------------------

@pytest.mark.slow
def test_resource_config_form_runs_every_process(tmp_path: Path, hd32_model_dir: Path) -> None:
    """configs/resource_config.yaml as written: FSDP actor on 2, vLLM rollout, a reward process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hd32_model_dir)
    trainer = HybridTrainer(actor_model=model, reward_model=digit_reward, run_dir=tmp_path / "run",
                            config=load_resource_config(RESOURCE_CONFIG),
                            overrides=[CPU, *SHORT, "resources.rollout.vllm_args.enforce_eager=true",
                                       "resources.rollout.vllm_args.kv_cache_space_gb=1"])
    result = trainer.train()
    assert result.steps == 2 and result.hf_model_dir is not None
    run = load_config(tmp_path / "run" / "config.yaml")
    assert run.model.path == str((tmp_path / "run" / "init_model").absolute())
    assert run.reward.function == f"{__name__}:digit_reward"
    logs = {p.name for p in (tmp_path / "run" / "logs").glob("*_rank*.log")}
    assert {"trainer_rank0.log", "trainer_rank1.log"} <= logs and any(n.startswith("reward_") for n in logs), logs


@pytest.mark.slow
def test_update_resource_during_a_run_resizes_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`trainer.update_resource(component="reward", ...)` while train() runs (from another thread)."""
    run_dir, steps = tmp_path / "run", 6
    trainer = HybridTrainer(config=REPO / "configs" / "quickstart_split.yaml", reward_model=digit_reward,
                            run_dir=run_dir, overrides=[
                                f"model.path={tiny_model_dir}", "~model.init_preset", f"trainer.total_steps={steps}",
                                "trainer.batch_size=16", "logging.progress=off", "trainer.save_hf_model=false",
                                "resources.reward={device_type: cpu, device_ids: [3], strategy: data_parallel}"])
    requested: list[Path | None] = []

    def resize_once_running() -> None:
        # As soon as the run has written its config (its workers are starting): the request then
        # lands at step 1's boundary. Waiting for step 1's metrics raced the run's end: the tiny
        # model's six steps can take less than a second once its workers are up.
        config = run_dir / "config.yaml"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not config.is_file():
            time.sleep(0.05)
        requested.append(trainer.update_resource(component="reward", device_ids=[3, 4], strategy="data_parallel"))

    helper = threading.Thread(target=resize_once_running, daemon=True)
    helper.start()
    result = trainer.train()
    helper.join(timeout=60)
    assert requested and requested[0] is not None and result.steps == steps
    [entry] = resize.history(run_dir)
    assert entry["after"]["reward"]["device_ids"] == [3, 4]
    rows = read_jsonl_metrics(run_dir / "tensorboard" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))


@pytest.mark.slow
def test_model_object_and_reward_function_reach_split_workers(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    result = HybridTrainer(actor_model=model, reward_model=digit_reward, config=REPO / "configs/quickstart_split.yaml",
                           run_dir=tmp_path / "run", overrides=[f"model.path={tiny_model_dir}", "~model.init_preset",
                                                                *SHORT]).train()
    assert result.steps == 2
    rows = read_jsonl_metrics(tmp_path / "run" / "tensorboard" / "metrics.jsonl")
    assert all(0.0 <= r["critic/score/mean"] <= 1.0 for r in rows)
    assert (tmp_path / "run" / "init_model" / "config.json").is_file()


@pytest.mark.parametrize("guarded", [True, False])
def test_a_scripts_reward_reaches_workers_only_behind_a_main_guard(tmp_path: Path, guarded: bool) -> None:
    """A worker loads the script to find the function; unguarded, it would start training again."""
    import subprocess
    import sys

    body = "    print(script_spec(score), importable_spec(score))\n"
    script = tmp_path / "train_script.py"
    script.write_text("from verl_hpc.api_objects import importable_spec, script_spec\n\n"
                      "def score(prompt, response, ground_truth, **_):\n    return 1.0\n\n"
                      + ("if __name__ == '__main__':\n" + body if guarded else body.strip() + "\n"))
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ([f"{script.resolve()}:score", "None"] if guarded else ["None", "None"])
