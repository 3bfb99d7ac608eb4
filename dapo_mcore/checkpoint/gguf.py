"""A GGUF file (llama.cpp's format) as an ordinary HF model directory, dequantised to float32.

transformers reads GGUF itself (it needs the `gguf` package): the quantised tensors are dequantised on
load, the tokenizer and its chat template are rebuilt from the file's metadata, and `save_pretrained`
writes safetensors + config.json + tokenizer files that every other part of dapo_mcore reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dapo_mcore.utils.errors import CheckpointError


def gguf_to_hf(gguf_file: Path, out_dir: Path) -> dict[str, Any]:
    """Write `gguf_file` as an HF directory `out_dir` (atomically: a .tmp sibling renamed at the end)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    if not gguf_file.is_file():
        raise CheckpointError(f"GGUF file not found: {gguf_file}")
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(gguf_file=name, dequantize=True)
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as err:  # the gguf package is missing
        raise CheckpointError(f"reading {gguf_file} needs the 'gguf' package: {err}") from None
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{gguf_file} is not a GGUF model transformers can read: {err}") from None
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    config = model.config
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": config.num_hidden_layers,
        "vocab": config.vocab_size,
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }
