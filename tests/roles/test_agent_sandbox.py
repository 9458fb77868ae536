"""The code tool's sandbox: what model-written code may not do is refused or killed, and the run goes on."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from verl_hpc.config.multi_turn import MultiTurnConfig
from verl_hpc.roles.agent import ToolCall, ToolRunner, load_tools
from verl_hpc.roles.agent.sandbox import SandboxLimits, configure, run_python_sandboxed

BACKENDS = [pytest.param("bwrap", marks=pytest.mark.skipif(not shutil.which("bwrap"), reason="bwrap not installed")),
            pytest.param("unshare", marks=pytest.mark.skipif(os.geteuid() != 0, reason="the unshare backend is root's"))]
LIMITS = {"cpu_seconds": 2, "memory_mb": 256, "wall_seconds": 8.0, "max_processes": 16}


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "run"
    (path / "secrets").mkdir(parents=True)
    (path / "secrets" / "flight_token").write_text("s3cret")
    os.chmod(path, 0o755)
    os.chmod(tmp_path, 0o755)
    return path


def sandboxed(code: str, backend: str, hidden: list[str] | None = None):
    return run_python_sandboxed(code, SandboxLimits(backend=backend, **LIMITS), hidden)


@pytest.mark.parametrize("backend", BACKENDS)
def test_denied_actions(backend: str, run_dir, tmp_path) -> None:
    ok = sandboxed("import os; print(6 * 7, os.getcwd() != '/'); open('mine.txt', 'w').write('x')", backend)
    assert ok.returncode == 0 and ok.stdout.startswith("42 True") and ok.limit is None

    net = sandboxed("import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=2)\nprint('open')", backend)
    assert net.returncode != 0 and "open" not in net.stdout and ("Error" in net.stderr)

    outside = tmp_path / "escaped.txt"
    write = sandboxed(f"open({str(outside)!r}, 'w').write('x'); print('wrote')", backend)
    assert write.returncode != 0 and not outside.exists()
    etc = sandboxed("open('/etc/verl_hpc_sandbox_probe', 'w').write('x'); print('wrote')", backend)
    assert etc.returncode != 0 and not os.path.exists("/etc/verl_hpc_sandbox_probe")

    token = run_dir / "secrets" / "flight_token"
    read = sandboxed(f"print(open({str(token)!r}).read())", backend, hidden=[str(run_dir)])
    assert read.returncode != 0 and "s3cret" not in read.stdout

    bomb = sandboxed("import os\nwhile True:\n    os.fork()", backend)
    assert bomb.returncode != 0 or "Resource temporarily unavailable" in bomb.stderr + bomb.stdout

    memory = sandboxed("x = bytearray(10 * 1024**3)\nprint('allocated')", backend)
    assert memory.limit == "memory" and "allocated" not in memory.stdout

    spin = sandboxed("while True:\n    pass", backend)
    assert spin.limit in ("cpu time", "wall-clock") and "killed by the sandbox" in spin.text()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_child_left_behind_dies_with_the_sandbox(backend: str) -> None:
    marker = "verl-hpc-sandbox-orphan-41"
    out = sandboxed(f"import subprocess\nsubprocess.Popen(['sleep', '300', '{marker}'], start_new_session=True)\n"
                    "print('spawned')", backend)
    assert out.stdout.startswith("spawned")
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout.strip() == ""


def test_the_code_tool_answers_the_model_and_the_run_goes_on(run_dir) -> None:
    backend = configure(SandboxLimits(**LIMITS), [str(run_dir)])
    assert backend in ("bwrap", "unshare")
    tools = load_tools(MultiTurnConfig(tools=["verl_hpc.roles.agent.sandbox:run_python"]))
    assert tools.schemas[0]["function"]["parameters"]["required"] == ["code"]
    runner = ToolRunner(tools, workers=2, timeout=30, max_chars=500, truncate_side="left")
    calls = [ToolCall("run_python", {"code": "print(sum(range(10)))"}),
             ToolCall("run_python", {"code": "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)"}),
             ToolCall("run_python", {"code": "x = bytearray(10 * 1024**3)"})]
    runner.max_parallel = 3
    outcomes = runner.submit("e", calls, {}).result()
    assert outcomes[0].text == "45" and outcomes[0].error is None
    assert outcomes[1].text.startswith("Error: exit code 1") and "OSError" in outcomes[1].text
    assert outcomes[2].text.startswith("Error: killed by the sandbox's memory limit")
    runner.close()
