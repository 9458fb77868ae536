"""`rollout.multi_turn`: agent episodes with tool calls instead of one sampled response per prompt.

Why verl's names (`enable`, `max_assistant_turns`, `max_user_turns`, `max_parallel_calls`,
`max_tool_response_length`, `tool_response_truncate_side`, `format`, `tool_config_path`): a verl
user's multi-turn section maps key for key. What verl has no key for is ours: plain Python
functions as tools (`tools`), a chat template for a tokenizer whose own ignores `tools=`, the tool
pool and timeouts, and the code sandbox's limits.

Budgets: `algorithm.sampling.max_new_tokens` is the model's own token budget for the whole
episode (tool output does not count against it; each turn gets what is left), so response-length
limits, metrics and the `-norm` aggregation keep meaning "tokens the model wrote".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from verl_hpc.config.base import StrictModel


class SandboxConfig(StrictModel):
    """Limits of the code tool's child process (`verl_hpc.roles.agent.sandbox`)."""

    backend: Literal["auto", "bwrap", "unshare"] = Field(
        "auto", description="auto: bubblewrap when `bwrap` is installed, else unshare + rlimits (logged)")
    cpu_seconds: int = Field(5, ge=1, description="RLIMIT_CPU of the child")
    memory_mb: int = Field(512, ge=16, description="RLIMIT_AS of the child (address space)")
    wall_seconds: float = Field(10.0, gt=0, description="the child is killed (its whole PID namespace) after this")
    max_processes: int = Field(32, ge=1, description="RLIMIT_NPROC for the unprivileged uid the code runs as")
    max_output_bytes: int = Field(65536, ge=1, description="stdout/stderr kept per run")


class EnvironmentConfig(StrictModel):
    """An environment that answers each model turn (a game, a simulator, a grader): verl_hpc.roles.env.

    Its rewards' sum reaches the reward function as `extra_info["env_reward"]`;
    `reward.function: verl_hpc.data.trajectory:environment_score` scores an episode by it alone."""

    source: Literal["textarena", "python", "openenv_server", "verifiers"] = Field(
        description="textarena: a TextArena game by id; python: a class (`module:Class` or `file.py:Class`) with "
        "reset/step, OpenEnv `Environment` subclasses included; openenv_server: an OpenEnv server by URL (a "
        "WebSocket session per episode); verifiers: a verifiers 0.4.0 environment by id, its harness driving "
        "each episode against the rollout engine")
    id: str = Field(description="the game id (GuessTheNumber-v0), the class, the server's URL, or the "
                    "verifiers environment id (vf-calc)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="given to the game's or class's constructor; "
                                   "verifiers: {python: its interpreter, args: vf-eval's flags, startup_seconds}")
    timeout_seconds: float = Field(30.0, gt=0, description="a reset or step running longer fails its episode "
                                   "(counted in env/failures); the run goes on")
    workers: int = Field(64, ge=1, description="environment calls running at once: over all episodes of a step "
                         "in threads, per worker with worker processes (more wait their turn in the rollout)")
    max_retries: int = Field(1, ge=0, description="an episode whose environment failed is run again from a "
                             "fresh reset (same seed), up to this many times; each failure counts in env/failures")
    num_workers: int = Field(0, ge=0, description="worker processes holding the environments (a crash or hang "
                             "costs their episodes, not the rollout; a dead worker is started again); 0 = "
                             "threads of the rollout process")
    action_wrappers: list[str] = Field(default_factory=list, description="TextArena action wrappers by name "
                                       "(`textarena.wrappers`), outermost first, that each model turn goes "
                                       "through before the game reads it: ActionFormattingWrapper brackets a bare "
                                       "`7` into the `[7]` games parse; textarena only")
    first_observation: bool = Field(True, description="the reset's observation (a TextArena game's rules and "
                                    "opening) is the episode's first user turn, after the row's prompt; false: "
                                    "the row's prompt alone opens the episode and the environment speaks from "
                                    "its first step on (a prompt that states the task, a model that cannot "
                                    "read the rules)")
    players: int = Field(1, ge=1, le=2, description="2: self-play, the policy plays both seats of a two-player "
                         "TextArena game (e.g. TicTacToe-v0); the samples of a prompt pair into matches (sample 2k "
                         "seat 0, 2k+1 seat 1, the row's seed), each seat an episode with its own reward")


class MultiTurnConfig(StrictModel):
    """Episodes of generate -> tool call -> tool reply -> generate, up to the turn and token budgets."""

    enable: bool = Field(False, description="run agent episodes (tool calls) instead of single responses")
    max_assistant_turns: int = Field(5, ge=1, description="model turns per episode at most (verl's key)")
    max_user_turns: int | None = Field(None, ge=1, description="tool/environment replies per episode at most "
                                       "(verl's key); unset = max_assistant_turns")
    max_parallel_calls: int = Field(1, ge=1, description="tool calls of one turn that run (verl's key); more "
                                    "get an error message")
    max_tool_response_length: int = Field(256, ge=1, description="characters of a tool reply kept (verl's key)")
    tool_response_truncate_side: Literal["left", "middle", "right"] = Field(
        "middle", description="which part of a long reply is cut (verl's key): left keeps the end")
    format: str = Field("hermes", description="tool-call format the model writes (a registered parser: hermes "
                        "= `<tool_call>{json}</tool_call>`, as Qwen templates render tools=)")
    tool_config_path: str | None = Field(None, description="verl's tool config file: `tools: [{class_name, "
                                         "config, tool_schema}]`")
    tools: list[str] = Field(default_factory=list, description="plain functions as tools, `module:function` or "
                             "`file.py:function`; the schema comes from type hints and the docstring")
    chat_template: str | None = Field(None, description="a Jinja chat template file that renders tools= (for a "
                                      "tokenizer whose own template ignores them, e.g. plain ChatML)")
    tool_timeout_seconds: float = Field(30.0, gt=0, description="a call running longer becomes an error "
                                        "message to the model")
    tool_workers: int = Field(64, ge=1, description="tool calls running at once, over all episodes of a step "
                              "(threads: a call waiting on I/O costs a thread, not a core)")
    max_tokens_per_turn: int | None = Field(None, ge=1, description="tokens one model turn samples at most; a "
                                            "turn reaching it ends there as if the model had closed it (the "
                                            "template writes its end-of-turn, untrained), and goes to the tools "
                                            "or the environment. Unset = only the episode's budgets")
    max_response_tokens: int | None = Field(None, ge=1, description="the whole response (model and inserted "
                                            "tokens) at most; an episode reaching it ends truncated. Unset = "
                                            "the model's context minus the prompt")
    deterministic_rounds: bool = Field(False, description="each generation round waits for every tool call the "
                                       "previous one started: the same seed samples the same episodes (exact "
                                       "resume), but tool latency is no longer hidden behind generation")
    partial_rollouts: bool = Field(False, description="episodes may span a weight update: between two "
                                   "generation rounds a rollout rank takes the trainer's newer weights as soon as "
                                   "they arrive, and each turn keeps the policy version that sampled it. Needs "
                                   "placement split, algorithm.max_staleness >= 1 and the hf engine; the turns "
                                   "then depend on timing, so a resumed run is no longer bitwise the same")
    add_tool_rewards: bool = Field(False, description="add the rewards tools return (turn-level) to the score")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="the code tool's limits")
    environment: EnvironmentConfig | None = Field(None, description="an environment answers each final turn "
                                                  "with the next user turn until it says done; each row's "
                                                  "`extra_info.env_seed` (else its index) seeds its reset")

    @property
    def user_turns(self) -> int:
        return self.max_user_turns or self.max_assistant_turns


class RolloutConfig(StrictModel):
    """How responses are produced (verl's `actor_rollout_ref.rollout` keys that are not resources)."""

    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
