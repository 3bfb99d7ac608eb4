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
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dapo_mcore.checkpoint.hf_io import copy_hf_files
from dapo_mcore.config.model_spec import ModelSpec
from dapo_mcore.mcore.mcore_compat import save_files_problem
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


# ----- completeness and integrity ---------------------------------------------------------------------------
# The manifest lists every file of a save with its size and CRC-32, written last: a save without one did not
# finish; a size that differs means a file cut short; a CRC that differs means bytes damaged after writing.
_CRC_BLOCK = 8 << 20


def file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as fh:
        while block := fh.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def write_manifest(ckpt: Path, known_crcs: dict[str, int] | None = None) -> None:
    """MANIFEST.json for every file under `ckpt`; `known_crcs` (relative name -> CRC-32) are those the writing
    ranks computed for their own shards, the rest are computed here."""
    known = known_crcs or {}
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        name = str(path.relative_to(ckpt))
        files[name] = {"bytes": path.stat().st_size, "crc32": known.get(name, None)}
        if files[name]["crc32"] is None:
            files[name]["crc32"] = file_crc32(path)
    atomic_write(ckpt / MANIFEST, json.dumps({"version": FORMAT_VERSION, "files": files}, indent=1))


def read_manifest(ckpt: Path) -> dict[str, dict[str, int | None]]:
    """name -> {"bytes", "crc32"} (crc32 None in manifests written before checksums)."""
    manifest = ckpt / MANIFEST
    try:
        files = dict(json.loads(manifest.read_text())["files"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is unreadable ({err})") from None
    return {
        name: entry if isinstance(entry, dict) else {"bytes": entry, "crc32": None} for name, entry in files.items()
    }


def checksum_share(files: dict[str, dict[str, int | None]], rank: int, world_size: int) -> list[str]:
    """The files whose CRC-32 rank `rank` of `world_size` checks: every file with a CRC goes to exactly one rank,
    largest first to the rank with the fewest bytes so far (ties: lower rank), so each reads about 1/world of
    the save. The same on every rank (a function of the manifest)."""
    loads = [0] * world_size
    mine = []
    for name in sorted((n for n, e in files.items() if e["crc32"] is not None), key=lambda n: (-files[n]["bytes"], n)):
        least = min(range(world_size), key=lambda r: (loads[r], r))
        loads[least] += files[name]["bytes"] or 1
        if least == rank:
            mine.append(name)
    return mine


def verify_complete(ckpt: Path, checksums: bool = False, share: tuple[int, int] = (0, 1)) -> int:
    """Raise a CheckpointError naming the file and what is wrong with a save that was cut short (sizes, always)
    or damaged (CRC-32, with checksums=True: of this rank's `share` = (rank, world size) of the files, see
    checksum_share; (0, 1) reads the whole save). Returns the number of files whose CRC-32 was checked (0 for
    a manifest written before checksums)."""
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
    files = read_manifest(ckpt)
    problem = save_files_problem(files)  # its files differ between Megatron-Core releases
    if problem:
        raise CheckpointError(f"checkpoint {ckpt} {problem}")
    for name, entry in files.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is incomplete: {name} is missing")
        if path.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {ckpt} is damaged: {name} has {path.stat().st_size} bytes, the manifest says "
                f"{entry['bytes']}"
            )
    if not checksums:
        return 0
    mine = checksum_share(files, *share)
    for name in mine:
        if file_crc32(ckpt / name) != files[name]["crc32"]:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {name} fails its CRC-32 check")
    return len(mine)


def saves_in(path: Path) -> list[Path]:
    """The saves `path` names: itself (a save), the step_* saves of a checkpoint directory, or those of a run
    directory's checkpoints/. A path with none is a CheckpointError."""
    if (path / MANIFEST).is_file() or (
        path.is_dir() and not any(path.glob("step_*")) and path.name.startswith("step_")
    ):
        return [path]
    for root in (path, path / "checkpoints"):
        saves = sorted(p for p in root.glob("step_*") if p.is_dir())
        if saves:
            return saves
    raise CheckpointError(f"{path}: no save here (a step_N directory, a checkpoint directory or a run directory)")


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
