"""docs/verl.md's key tables are generated from config/verl_keys.py and must be up to date."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO
from verl_hpc.config.verl_keys import IGNORED, KEYS


def test_verl_key_tables_are_up_to_date() -> None:
    result = subprocess.run([sys.executable, "tools/gen_verl_docs.py", "--check"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, "docs/verl.md is out of date; run `python tools/gen_verl_docs.py`\n" + result.stderr


def test_every_key_and_ignored_key_is_documented() -> None:
    text = (REPO / "docs" / "verl.md").read_text()
    missing = [k for k in [*(row.key for row in KEYS), *IGNORED] if f"`{k}`" not in text]
    assert not missing, missing
