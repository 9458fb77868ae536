"""Multiply two integers with a tool: a verifiers 0.4.0 tool environment small enough for a 135M model.

Why three worked calls in the prompt: asked alone, SmolLM2-135M-Instruct answers from memory (often
wrongly) or names a tool that does not exist; after three worked calls it calls `calc_multiply` with
the question's numbers and answers from the tool's reply.
"""

import verifiers.v1 as vf

from vf_calc.servers.tool import VfCalcToolset

SHOTS = [(2, 3), (7, 8), (12, 4)]


def prompt(a: int, b: int) -> vf.Messages:
    """Worked calls first: the tiny model copies their form."""
    messages: vf.Messages = []
    for i, (x, y) in enumerate(SHOTS):
        call = vf.ToolCall(id=f"call_{i}", name="calc_multiply", arguments=f'{{"a": {x}, "b": {y}}}')
        messages += [vf.UserMessage(content=f"What is {x} times {y}? Use calc_multiply."),
                     vf.AssistantMessage(content=None, tool_calls=[call]),
                     vf.ToolMessage(tool_call_id=f"call_{i}", content=str(x * y)),
                     vf.AssistantMessage(content=f"{x} times {y} is {x * y}.")]
    return [*messages, vf.UserMessage(content=f"What is {a} times {b}? Use calc_multiply.")]


class VfCalcData(vf.TaskData):
    product: int
    """The answer the final reply must hold."""


class VfCalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class VfCalcTask(vf.Task[VfCalcData, vf.State, VfCalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: VfCalcTaskConfig) -> list[vf.Toolset]:
        return [VfCalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.product) in trace.last_reply)


class VfCalcConfig(vf.TasksetConfig):
    num_tasks: int = 4
    task: VfCalcTaskConfig = VfCalcTaskConfig()


class VfCalcTaskset(vf.Taskset[VfCalcTask, VfCalcConfig]):
    def load(self) -> list[VfCalcTask]:
        pairs = [(3 + i, 7 + 2 * i) for i in range(self.config.num_tasks)]
        return [VfCalcTask(VfCalcData(prompt=prompt(a, b), product=a * b),
                           self.config.task) for a, b in pairs]
