"""Model weights as a Megatron-Core distributed checkpoint: the converters' output and every run save's "model".

    <ckpt>/                   dist_checkpointing files; "format" in the common state (version, kind,
                              model spec, layout saved at, step)
    <ckpt>/hf_assets/         config.json and tokenizer files of the HF model it came from
    <ckpt>/MANIFEST.json      written last: every file with its size; a checkpoint without it is incomplete

Weights are stored as sharded tensors keyed by global parameter name (global layer index), so a checkpoint
written at one TP x PP layout loads at any other: dist_checkpointing reads each rank's slice.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dapo_mcore.checkpoint.hf_io import copy_hf_files
from dapo_mcore.mcore.provider import ModelSpec
from dapo_mcore.mcore.sharding import unwrap
from dapo_mcore.utils.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
HF_ASSETS = "hf_assets"


def model_sharded_state_dict(chunks: list[Any]) -> dict[str, Any]:
    """{"chunk<i>": that chunk's sharded state dict}. The dict keys are local; the ShardedTensors inside carry
    global keys (global layer index), which alone decide where data lives on disk."""
    return {f"chunk{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def format_record(kind: str, spec: ModelSpec, chunks: list[Any], layout: dict[str, int], step: int = 0) -> dict:
    dtype = str(next(unwrap(chunks[0]).parameters()).dtype).removeprefix("torch.")
    return {
        "version": FORMAT_VERSION,
        "kind": kind,
        "model_spec": asdict(spec),
        "dtype": dtype,
        "layout": layout,
        "step": step,
    }


def cast_parameters(chunks: list[Any], dtype: torch.dtype) -> None:
    """Parameters only (rotary frequencies and other buffers keep their precision); the objects stay the
    same, so Megatron's parallel attributes on them survive."""
    for chunk in chunks:
        for param in chunk.parameters():
            param.data = param.data.to(dtype)


def read_format(ckpt: Path) -> dict[str, Any]:
    """The "format" record of a complete checkpoint (checked against its manifest first)."""
    return read_common(ckpt)["format"]


def read_common(ckpt: Path) -> dict[str, Any]:
    """The common (non-sharded) state of a complete dapo_mcore checkpoint (checked against its manifest)."""
    from megatron.core import dist_checkpointing

    verify_complete(ckpt)
    try:
        common = dist_checkpointing.load_common_state_dict(str(ckpt))
    except Exception as err:  # the manifest vouched for the file, yet it does not unpickle
        raise CheckpointError(f"checkpoint {ckpt}: common.pt unreadable ({type(err).__name__}: {err})") from err
    if not isinstance(common, dict) or "format" not in common or common["format"].get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt} is not a dapo_mcore checkpoint of format version {FORMAT_VERSION}")
    return common


def check_model_spec(saved: dict[str, Any], spec: ModelSpec, where: Path, source: str = "model.hf_path") -> None:
    """The checkpoint's architecture must be the model's: name every field that differs, with both values."""
    wrong = [
        f"{field}: checkpoint {saved[field]!r}, {source} {value!r}"
        for field, value in asdict(spec).items()
        if field in saved and saved[field] != value
    ]
    if wrong:
        raise CheckpointError(f"{where} holds another model than {source} describes ({'; '.join(wrong)})")


def load_model_weights(chunks: list[Any], ckpt: Path, spec: ModelSpec, source: str = "model.hf_path") -> None:
    """Load only the model weights of a checkpoint (a converted one or a run save) into this rank's chunks."""
    from megatron.core import dist_checkpointing

    found = read_format(ckpt)
    check_model_spec(found["model_spec"], spec, ckpt, source)
    model_dtype, stored = next(chunks[0].parameters()).dtype, getattr(torch, found.get("dtype", "float32"))
    cast_parameters(chunks, stored)  # read at the stored precision, then cast (exact when widening)
    try:
        loaded = dist_checkpointing.load({"model": model_sharded_state_dict(chunks)}, str(ckpt))
    except Exception as err:  # a file the manifest vouched for, yet unreadable
        raise CheckpointError(f"checkpoint {ckpt} could not be read: {type(err).__name__}: {err}") from err
    for i, chunk in enumerate(chunks):
        unwrap(chunk).load_state_dict(loaded["model"][f"chunk{i}"], strict=True)
    cast_parameters(chunks, model_dtype)


def copy_hf_assets(hf_dir: Path, ckpt: Path) -> None:
    """Copy config.json and the tokenizer files of `hf_dir` to `<ckpt>/hf_assets` (rank 0)."""
    copy_hf_files(Path(hf_dir), ckpt / HF_ASSETS)


# ----- completeness ---------------------------------------------------------------------------------------
def write_manifest(ckpt: Path) -> None:
    files = {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file()}
    atomic_write(ckpt / MANIFEST, json.dumps({"version": FORMAT_VERSION, "files": files}, indent=1))


def verify_complete(ckpt: Path) -> None:
    """Raise a CheckpointError that says what is wrong with a checkpoint that was cut short."""
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {ckpt} does not exist")
    manifest = ckpt / MANIFEST
    if not manifest.is_file() and any(ckpt.glob("step_*")):
        raise CheckpointError(
            f"{ckpt} is a directory of saves, not one save: name one of them (step_NNNNNN) "
            "or use checkpoint.resume=auto"
        )
    if not manifest.is_file():
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: no {MANIFEST} (the save did not finish)")
    try:
        files = dict(json.loads(manifest.read_text())["files"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is unreadable ({err})") from None
    for name, size in files.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is incomplete: {name} is missing")
        if path.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {ckpt} is damaged: {name} has {path.stat().st_size} bytes, the manifest says {size}"
            )
    for needed in ("metadata.json", ".metadata", "common.pt"):
        if needed not in files:
            raise CheckpointError(f"checkpoint {ckpt} has no {needed}: not a complete distributed checkpoint")


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
