"""Streaming HF safetensors I/O: read one tensor at a time, load into this rank's Megatron shards."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.mcore.provider import padded_vocab_size
from dapo_mcore.mcore.sharding import global_named_parameters, shard_of, tp_split_of
from dapo_mcore.utils.errors import CheckpointError

# The HF files that describe a model without being its weights: copied along so an export is loadable.
_ASSET_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template*",
)
# The weights a model can be trained from, by their safetensors names: unquantized floating point. An integer
# tensor (a quantized checkpoint, or weights scaled and rounded) was cast to the model's dtype as it was: the
# run trained a model of garbage with accuracy 0 and exit code 0. Float8 weights need their scales (quantized).
FLOAT_WEIGHT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
_TORCH_FLOATS = {getattr(torch, name) for name in FLOAT_WEIGHT_DTYPES.values()}
_OTHER_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                 "U32": "uint32", "I64": "int64", "U64": "uint64", "F8_E4M3": "float8_e4m3fn",
                 "F8_E5M2": "float8_e5m2"}  # fmt: skip


class SafetensorsReader:
    """Lazy access to the tensors of an HF directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(
                    f"{index} is not a valid safetensors index ({type(err).__name__}: {err})"
                ) from None
        elif (self.hf_dir / "model.safetensors").is_file():
            with _readable(self.hf_dir / "model.safetensors"), safe_open(self.hf_dir / "model.safetensors", "pt") as fh:
                weight_map = {k: "model.safetensors" for k in fh.keys()}  # noqa: SIM118 (not a dict)
        else:
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {self.hf_dir}")
        self.weight_map: dict[str, str] = weight_map
        self._open = safe_open

    def names(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.hf_dir}: tensor '{name}' is missing from the checkpoint")
        path = self.hf_dir / self.weight_map[name]
        if not path.is_file():
            raise CheckpointError(f"{self.hf_dir}: shard file {path.name} (holding '{name}') is missing")
        with _readable(path), self._open(path, framework="pt") as fh:
            tensor = fh.get_tensor(name)
        if tensor.dtype not in _TORCH_FLOATS:  # (check_weight_dtypes refuses it before anything is built)
            raise CheckpointError(_not_float(path, name, str(tensor.dtype).removeprefix("torch.")))
        return tensor


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(the tensors' entries {name: {dtype, shape, data_offsets}}, the bytes the file must hold) from a
    safetensors file's header alone (no tensor data read). A CheckpointError names a file whose header is not
    one."""
    try:
        with open(path, "rb") as fh:
            length = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(length))
    except (OSError, struct.error, ValueError, MemoryError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {type(err).__name__}: {err}") from None
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((entry["data_offsets"][1] for entry in entries.values()), default=0)
    return entries, 8 + length + end


def weights_problems(hf_dir: Path, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """What `train` would meet reading these weights, from the safetensors headers alone (one line each): a file
    cut short (an interrupted download), a tensor that is not a float (quantized weights), a tensor whose shape
    is not the one config.json gives, tensors missing."""
    index = hf_dir / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    except (ValueError, KeyError, TypeError) as err:
        return [f"{index} is not a valid safetensors index ({type(err).__name__}: {err})"]
    files = files or [p.name for p in sorted(hf_dir.glob("*.safetensors"))]
    problems, found, dtypes = [], {}, {}
    for name in files:
        path = hf_dir / name
        if not path.is_file():
            problems.append(f"{path} is missing (named by {index.name})")
            continue
        try:
            entries, needed = safetensors_header(path)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        if path.stat().st_size < needed:
            problems.append(f"{path} is cut short: {path.stat().st_size:,} bytes, its header needs {needed:,} "
                            "(an interrupted copy or download?)")  # fmt: skip
        found.update({tensor: (name, tuple(entry["shape"])) for tensor, entry in entries.items()})
        dtypes.update({tensor: (name, str(entry.get("dtype"))) for tensor, entry in entries.items()})
    problems += [p for p in [weight_dtype_problem(hf_dir, dtypes)] if p]
    differ = [tensor for tensor, shape in expected.items() if tensor in found and found[tensor][1] != shape]
    for tensor in differ[:3]:
        problems.append(f"{hf_dir}: '{tensor}' has shape {list(found[tensor][1])} in {found[tensor][0]}, "
                        f"config.json makes it {list(expected[tensor])}")  # fmt: skip
    if len(differ) > 3:
        problems.append(f"{hf_dir}: {len(differ) - 3} more tensors differ in shape from config.json")
    missing = [tensor for tensor in expected if tensor not in found]
    if missing and files:
        problems.append(f"{hf_dir}: {len(missing)} of the {len(expected)} tensors config.json makes are in no "
                        f"*.safetensors file (the first: '{missing[0]}')")  # fmt: skip
    return problems


def weight_dtypes(hf_dir: Path) -> dict[str, tuple[str, str]]:
    """Tensor name -> (its file's name, its safetensors dtype: "BF16", "I32", ...) of every *.safetensors file
    in hf_dir, from the headers alone. A file whose header cannot be read is left out: the weights' other checks
    name it (weights_problems, SafetensorsReader)."""
    found: dict[str, tuple[str, str]] = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        try:
            entries, _ = safetensors_header(path)
        except CheckpointError:
            continue
        found.update({tensor: (path.name, str(entry.get("dtype"))) for tensor, entry in entries.items()})
    return found


def weight_dtype_problem(hf_dir: Path, dtypes: dict[str, tuple[str, str]]) -> str | None:
    """One line naming the file and the first weight whose dtype is not an unquantized float (weight_dtypes)."""
    dtypes = _weights_alone(dtypes)
    odd = [(tensor, file, dtype) for tensor, (file, dtype) in dtypes.items() if dtype not in FLOAT_WEIGHT_DTYPES]
    if not odd:
        return None
    tensor, file, dtype = odd[0]
    more = f" (and {len(odd) - 1} more of the {len(dtypes)} weights)" if len(odd) > 1 else ""
    return _not_float(Path(hf_dir) / file, tensor, _OTHER_DTYPES.get(dtype, dtype), more)


def _not_float(path: Path, tensor: str, dtype: str, more: str = "") -> str:
    return (
        f"{path}: tensor '{tensor}' is {dtype}, not a floating-point weight{more}: quantized or converted "
        f"weights cannot be trained (allowed: {', '.join(FLOAT_WEIGHT_DTYPES.values())})"
    )


def weight_dtype_note(hf_dir: Path, dtypes: dict[str, tuple[str, str]], config_dtype: Any) -> str | None:
    """A line when float weights are of another dtype than config.json's: they load (cast to model.dtype) but
    the file and its config disagree."""
    if config_dtype not in FLOAT_WEIGHT_DTYPES.values():
        return None
    dtypes = _weights_alone(dtypes)
    other = [(t, f, FLOAT_WEIGHT_DTYPES[d]) for t, (f, d) in dtypes.items()
             if d in FLOAT_WEIGHT_DTYPES and FLOAT_WEIGHT_DTYPES[d] != config_dtype]  # fmt: skip
    if not other:
        return None
    tensor, file, dtype = other[0]
    return (
        f"{hf_dir}: {len(other)} of the {len(dtypes)} weights are {dtype} (the first: '{tensor}' in {file}), "
        f"config.json says {config_dtype}; they are loaded and cast to model.dtype"
    )


def _weights_alone(dtypes: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """The parameters (`.weight`, `.bias`): a buffer saved beside them (older checkpoints' int64 `position_ids`,
    `rotary_emb.inv_freq`) is not loaded, whatever its dtype."""
    return {name: entry for name, entry in dtypes.items() if name.endswith((".weight", ".bias"))}


def check_weight_dtypes(hf_dir: str | Path, config: dict[str, Any]) -> str | None:
    """Before a run builds anything (from the headers alone): a CheckpointError naming the file and the tensor
    when a weight is not an unquantized float; a line to warn with when float weights disagree with
    config.json's dtype (None when they agree)."""
    dtypes = weight_dtypes(Path(hf_dir))
    problem = weight_dtype_problem(Path(hf_dir), dtypes)
    if problem is not None:
        raise CheckpointError(problem)
    return weight_dtype_note(Path(hf_dir), dtypes, config.get("dtype") or config.get("torch_dtype"))


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    """A damaged safetensors file (cut short, garbled header) as one CheckpointError naming it."""
    try:
        yield
    except Exception as err:
        if type(err).__name__ != "SafetensorError" and not isinstance(err, OSError):
            raise
        raise CheckpointError(f"{path} is not a readable safetensors file (cut short?): {err}") from None


@torch.no_grad()
def load_hf_weights(
    model_chunks: list[torch.nn.Module],
    hf_dir: str | Path,
    family: LlamaFamilyMap,
    tp_rank: int,
    tp_size: int,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> None:
    """Copy the HF checkpoint's weights into this rank's Megatron shards, one parameter at a time (only the
    experts this rank holds; an expert's weights split over the expert TP ranks, by default the TP ones)."""
    reader = SafetensorsReader(hf_dir)
    padded = padded_vocab_size(family.spec.vocab_size, tp_size)
    expert_tp = (tp_rank if etp_rank is None else etp_rank, tp_size if etp_size is None else etp_size)
    for chunk in model_chunks:
        for name, param in global_named_parameters(chunk):
            full = family.hf_to_mcore(name, [reader.get(n) for n in family.hf_sources(name)])
            split = tp_split_of(name, param)
            rank, size = expert_tp if split.expert else (tp_rank, tp_size)
            local = shard_of(full, split, rank, size, padded)
            if local.shape != param.shape:
                raise CheckpointError(
                    f"{hf_dir}: '{name}' gives a shard of shape {tuple(local.shape)}, the model "
                    f"expects {tuple(param.shape)} (does config.json match the weights?)"
                )
            param.copy_(local.to(param.dtype))


class SafetensorsShardWriter:
    """Write HF-named tensors as they come into `model-0000i-of-0000n.safetensors` shards of about
    `shard_bytes` each, plus `model.safetensors.index.json`: at most one shard is held in memory."""

    def __init__(self, out_dir: str | Path, shard_bytes: int = 2 << 30):
        self.out_dir, self.shard_bytes = Path(out_dir), shard_bytes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes, self._written, self._weight_map = 0, [], {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._weight_map or name in self._pending:
            raise CheckpointError(f"tensor '{name}' was exported twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes

    def close(self) -> int:
        """Write the last shard, give the shards their final names and write the index; returns bytes."""
        self._flush()
        total = len(self._written)
        index: dict[str, str] = {}
        for i, tmp_name in enumerate(self._written):
            final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            (self.out_dir / tmp_name).rename(self.out_dir / final)
            # safetensors writes its files for their owner alone (0600); an export is for others to read too
            (self.out_dir / final).chmod(0o666 & ~_umask())
            index.update({name: final for name, shard in self._weight_map.items() if shard == tmp_name})
        size = sum((self.out_dir / f).stat().st_size for f in set(index.values()))
        meta = {"metadata": {"total_size": size}, "weight_map": dict(sorted(index.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(meta, indent=2))
        return size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._pending:
            return
        tmp_name = f".shard-{len(self._written):05d}.safetensors"
        save_file(self._pending, str(self.out_dir / tmp_name), metadata={"format": "pt"})
        self._weight_map.update({name: tmp_name for name in self._pending})
        self._written.append(tmp_name)
        self._pending, self._pending_bytes = {}, 0


def copy_hf_files(src_dir: Path, dst_dir: Path) -> None:
    """Copy config.json, generation config and tokenizer files (never weights) from src_dir to dst_dir."""
    import shutil

    dst_dir.mkdir(parents=True, exist_ok=True)
    for pattern in _ASSET_PATTERNS:
        for src in Path(src_dir).glob(pattern):
            if src.is_file() and not src.name.endswith(".index.json"):
                shutil.copy2(src, dst_dir / src.name)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_hf_config(source_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """config.json (with the exported dtype) and the tokenizer files of source_dir next to exported weights."""
    copy_hf_files(source_dir, out_dir)
    config = json.loads((Path(source_dir) / "config.json").read_text())
    key = "dtype" if "dtype" in config else "torch_dtype"  # transformers 5 writes "dtype"
    config[key] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
