"""tools/check-image: what counts as a compiler toolchain in an image, on made-up root filesystems.

The real image is checked by tests/slurm/test_container_image.py; here the rules themselves.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "check-image"

STATUS = """Package: libgcc-s1
Status: install ok installed

Package: gcc-12-base
Status: install ok installed

Package: python3
Status: install ok installed

Package: gcc-12
Status: deinstall ok config-files
"""


def load_tool():  # -> module
    loader = importlib.machinery.SourceFileLoader("check_image", str(TOOL))
    spec = importlib.util.spec_from_loader("check_image", loader)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    loader.exec_module(module)
    return module


def make_root(root: Path, status: str = STATUS) -> Path:
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text(status)
    for name in ("usr/bin/python3", "opt/verl-hpc/venv/bin/ninja", "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("#!/bin/sh\n")
        (root / name).chmod(0o755)
    (root / "opt/verl-hpc/venv/lib/numpy/core/include").mkdir(parents=True)
    (root / "opt/verl-hpc/venv/lib/numpy/core/include/ndarrayobject.h").write_text("")
    return root


def run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), str(root)], text=True, capture_output=True, timeout=60,
                          check=False)


def test_a_clean_root_passes(tmp_path: Path) -> None:
    """Runtime libraries, gcc's copyright-only base package, a removed gcc, package headers: all fine."""
    done = run(make_root(tmp_path))
    assert done.returncode == 0, done.stdout
    assert done.stdout.startswith("no compiler toolchain:")


def test_compilers_linkers_dev_packages_and_system_headers_are_found(tmp_path: Path) -> None:
    root = make_root(tmp_path, STATUS + "\nPackage: libpython3.11-dev:amd64\nStatus: install ok installed\n"
                     "\nPackage: binutils\nStatus: install ok installed\n")
    for name in ("usr/bin/x86_64-linux-gnu-gcc-12", "usr/bin/ld.bfd", "usr/lib/gcc/x86_64-linux-gnu/12/cc1"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
        (root / name).chmod(0o755)
    (root / "usr/bin/cc").symlink_to("x86_64-linux-gnu-gcc-12")
    (root / "usr/include").mkdir()
    (root / "usr/include/stdio.h").write_text("")
    done = run(root)
    assert done.returncode == 1
    found = set(done.stdout.splitlines())
    assert {"toolchain: package libpython3.11-dev", "toolchain: package binutils",
            "toolchain: executable /usr/bin/x86_64-linux-gnu-gcc-12", "toolchain: executable /usr/bin/ld.bfd",
            "toolchain: executable /usr/bin/cc", "toolchain: executable /usr/lib/gcc/x86_64-linux-gnu/12/cc1",
            "toolchain: headers in /usr/include: 1 (e.g. /usr/include/stdio.h)"} == found


def test_installed_packages_reads_dpkg_status() -> None:
    assert load_tool().installed_packages(STATUS) == ["libgcc-s1", "gcc-12-base", "python3"]
