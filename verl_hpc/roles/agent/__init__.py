"""Multi-turn agent rollouts: tools, tool-call parsers, chat-template deltas, the sandbox and the loop.

Build order of a run: `AgentRollout(cfg.rollout.multi_turn, engine, tokenizer, eot_ids)` loads and
checks the tools, probes the chat template and starts the tool pool; a placement then calls
`rows(...)` per step and reads `metrics()`.
"""

from verl_hpc.roles.agent.episode import Episode, agent_metrics
from verl_hpc.roles.agent.loop import AgentLoop
from verl_hpc.roles.agent.parsers import ParsedTurn, ToolCall, ToolCallParser, get_parser, register_parser
from verl_hpc.roles.agent.render import ChatRenderer
from verl_hpc.roles.agent.rollout import AgentRollout, ToolRewardAdded
from verl_hpc.roles.agent.tool_runner import ToolOutcome, ToolRunner
from verl_hpc.roles.agent.tools import BaseTool, FunctionTool, ToolResponse, ToolSchema, ToolSet, load_tools

__all__ = ["AgentLoop", "AgentRollout", "BaseTool", "ChatRenderer", "Episode", "FunctionTool", "ParsedTurn",
           "ToolCall", "ToolCallParser", "ToolOutcome", "ToolResponse", "ToolRewardAdded", "ToolRunner",
           "ToolSchema", "ToolSet", "agent_metrics", "get_parser", "load_tools", "register_parser"]
