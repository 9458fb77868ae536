"""The host allocator of a run's processes (utils/host_allocator.py): TCMalloc on the CPU unless chosen otherwise.

The choice is pure and tested case by case; the restart is tested for real (a process that
re-executes itself and finds TCMalloc in its own memory map), and so is the CLI: a split run's
every worker runs under it. Under Slurm each task restarts itself (tests/slurm/test_submit.py).
tools/test.sh installs libtcmalloc-minimal4, so these tests require it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli
from verl_hpc.config import ConfigError, load_config
from verl_hpc.utils.host_allocator import (
    APPLIED_ENV,
    QUIET_LARGE_ALLOCS,
    active_allocator,
    allocator_line,
    choose_allocator,
    find_tcmalloc,
    library_dirs,
    needs_reexec,
    preloaded_allocator,
)

LIB = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
REPO = Path(__file__).resolve().parents[2]


def test_auto_preloads_tcmalloc_for_cpu_processes_only() -> None:
    chosen = choose_allocator("auto", {"cpu"}, {"LD_PRELOAD": "/opt/libmine.so"}, LIB)
    assert chosen.name == "tcmalloc"
    assert chosen.env == {"LD_PRELOAD": f"{LIB}:/opt/libmine.so", APPLIED_ENV: "tcmalloc", **QUIET_LARGE_ALLOCS}
    assert LIB in chosen.line() and needs_reexec(chosen, {})
    assert choose_allocator("auto", {"cpu"}, {}, LIB).env["LD_PRELOAD"] == LIB
    # a user's own threshold for the large-allocation report is kept
    assert "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD" not in choose_allocator(
        "auto", {"cpu"}, {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "1"}, LIB).env
    gpu = choose_allocator("auto", {"cpu", "cuda"}, {}, LIB)
    assert (gpu.name, gpu.env) == ("glibc", {}) and "GPU" in gpu.reason
    missing = choose_allocator("auto", {"cpu"}, {}, None)
    assert (missing.name, missing.env) == ("glibc", {}) and "libtcmalloc-minimal4" in missing.reason


def test_an_explicit_choice_or_a_users_preload_wins() -> None:
    assert choose_allocator("glibc", {"cpu"}, {}, LIB).env == {}
    assert choose_allocator("tcmalloc", {"cuda"}, {}, LIB).env["LD_PRELOAD"] == LIB
    with pytest.raises(ValueError, match="no TCMalloc library"):
        choose_allocator("tcmalloc", {"cpu"}, {}, None)
    jemalloc = choose_allocator("tcmalloc", {"cpu"}, {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, LIB)
    assert (jemalloc.name, jemalloc.env) == ("preloaded", {}) and "jemalloc" in jemalloc.reason
    # a child of a restarted process: already under it, never restarted again
    child = choose_allocator("auto", {"cpu"}, {"LD_PRELOAD": LIB, APPLIED_ENV: "tcmalloc"}, LIB)
    assert (child.name, child.env) == ("tcmalloc", {}) and not needs_reexec(child, {})
    assert not needs_reexec(choose_allocator("auto", {"cpu"}, {}, LIB), {APPLIED_ENV: "tcmalloc"})
    with pytest.raises(ValueError, match="not one of"):
        choose_allocator("mimalloc", {"cpu"}, {}, LIB)


def test_the_library_is_found_by_full_path_and_the_active_one_read_from_the_memory_map() -> None:
    present = {"/env/lib/libtcmalloc.so.4", "/usr/lib64/libtcmalloc_minimal.so.4"}
    assert library_dirs(["/env", ""])[0] == "/env/lib"
    assert find_tcmalloc(library_dirs(["/env"]), present.__contains__) == "/usr/lib64/libtcmalloc_minimal.so.4"
    assert find_tcmalloc(["/usr/lib"], present.__contains__) is None
    assert preloaded_allocator("/a/libjemalloc.so.2 /b/x.so") == "jemalloc"
    assert preloaded_allocator("/b/x.so") is None
    maps = "7f0-7f1 r-xp 00000000 08:01 42   /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n"
    assert active_allocator(maps) == "tcmalloc (libtcmalloc_minimal.so.4.5.10)"
    assert active_allocator("7f0-7f1 r-xp 0 0 1 /usr/lib/libc.so.6\n") == "glibc"
    assert "libtcmalloc-minimal4" in allocator_line("glibc", "cpu", "auto")  # the fix, where it applies
    assert "apt-get" not in allocator_line("glibc", "cpu", "glibc") + allocator_line("glibc", "cuda", "auto")
    assert allocator_line("tcmalloc (x.so)", "cpu", "auto") == \
        "memory plan: host allocator tcmalloc (x.so) (resources.host_allocator: auto)"


def installed() -> str:
    found = find_tcmalloc(library_dirs([sys.prefix]))
    assert found, "no TCMalloc here: tools/test.sh installs libtcmalloc-minimal4 (apt)"
    return found


def test_a_process_restarts_itself_under_tcmalloc() -> None:
    installed()
    script = ("import os; from verl_hpc.utils.host_allocator import *\n"
              "chosen = local_choice('auto', {'cpu'})\n"
              "if needs_reexec(chosen, os.environ): reexec(chosen)\n"
              "print(own_allocator(), os.environ[APPLIED_ENV])\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("LD_PRELOAD", APPLIED_ENV)}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, text=True, capture_output=True,
                         timeout=120, check=True).stdout
    assert out.startswith("tcmalloc (libtcmalloc") and out.split()[-1] == "tcmalloc", out


def test_free_pages_are_handed_back_under_tcmalloc_only() -> None:
    lib = installed()
    script = ("from verl_hpc.utils.host_allocator import release_free_memory\n"
              "blocks = [bytearray(1 << 20) for _ in range(64)]; del blocks\n"
              "print(release_free_memory())\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "LD_PRELOAD"}
    for preload, expected in ((lib, "True"), (None, "False")):
        run_env = {**env, "LD_PRELOAD": preload} if preload else env
        out = subprocess.run([sys.executable, "-c", script], env=run_env, cwd=REPO, text=True, capture_output=True,
                             timeout=120, check=True).stdout.strip()
        assert out == expected, (preload, out)


def test_explicit_tcmalloc_without_the_library_is_refused_by_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_hpc.config.machine import check_machine

    monkeypatch.setattr("verl_hpc.utils.host_allocator.find_tcmalloc", lambda dirs, exists=None: None)
    cfg = load_config(REPO / "configs" / "quickstart.yaml", ["resources.host_allocator=tcmalloc"])
    with pytest.raises(ConfigError, match="resources.host_allocator") as err:
        check_machine(cfg)
    assert "libtcmalloc-minimal4" in err.value.one_line()
    check_machine(load_config(REPO / "configs" / "quickstart.yaml"))  # auto: glibc, no error


@pytest.mark.slow
def test_train_runs_every_cpu_worker_under_tcmalloc(tmp_path: Path) -> None:
    installed()
    done = run_cli("train", "configs/quickstart_split.yaml", "trainer.total_steps=1",
                   "--run-dir", str(tmp_path / "run"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verl-hpc: host allocator" not in done.stderr  # the restart is silent: a bad config prints one line
    logs = sorted((tmp_path / "run" / "logs").glob("*_rank*.log"))
    assert len(logs) == 4
    for log in logs:
        assert "host allocator tcmalloc (libtcmalloc" in log.read_text(), log
