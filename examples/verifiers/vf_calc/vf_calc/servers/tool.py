import verifiers.v1 as vf


class VfCalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b


if __name__ == "__main__":
    VfCalcToolset.run()
