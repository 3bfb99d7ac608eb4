"""HF <-> Megatron-Core checkpoint conversion and its check; the logic behind tools/convert_*.py and
tools/check_conversion.py.

Both directions go through the family maps of checkpoint/convert/ (the ones the weight push uses) one
parameter at a time: the model is built once, at TP=1 x PP=1 on the CPU, and each tensor is read, mapped
and written on its own, so no model is ever held twice. The Megatron side is a distributed checkpoint of
global (unsharded) names, which loads at any TP x PP layout.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.checkpoint.hf_io import SafetensorsShardWriter, load_hf_weights, write_hf_config
from dapo_mcore.checkpoint.model_checkpoint import (
    HF_ASSETS,
    cast_parameters,
    check_model_spec,
    copy_hf_assets,
    dir_bytes,
    format_record,
    load_model_weights,
    model_sharded_state_dict,
    read_format,
    write_manifest,
)
from dapo_mcore.config.model_spec import ModelSpec, load_hf_config, read_model_spec
from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config, check_model_layout
from dapo_mcore.mcore.sharding import TPSplit, gather_full, global_named_parameters, tp_split_of
from dapo_mcore.parallel import ParallelContext, init_parallel
from dapo_mcore.utils.errors import CheckpointError, DapoError
from dapo_mcore.utils.logging import get_logger, quiet_save_reading

log = get_logger(__name__)


def build_model(spec: ModelSpec, ctx: ParallelContext, dtype: str) -> list[Any]:
    """The local-spec GPT chunks of this rank (conversion and checks run the model as written, no TE; a MoE's
    tokens reach their experts by all-gather, which gloo runs at any TP)."""
    config = build_transformer_config(
        spec,
        tp=ctx.tp_size,
        pp=ctx.pp_size,
        dtype=dtype,
        on_cpu=ctx.is_cpu,
        use_te=False,
        vpp=ctx.vpp_size,
        moe_dispatcher="allgather",
    )
    return build_gpt_chunks(spec, config, ctx=ctx, use_te=False)


def spec_from_checkpoint(ckpt: Path) -> ModelSpec:
    """The model spec a checkpoint was saved with, re-read from its HF config (validated the same way)."""
    saved = read_format(ckpt)["model_spec"]
    assets = ckpt / HF_ASSETS / "config.json"
    if not assets.is_file():
        raise CheckpointError(f"{ckpt} has no {HF_ASSETS}/config.json: cannot tell which HF model it is")
    spec = read_model_spec(json.loads(assets.read_text()))
    check_model_spec(saved, spec, ckpt, source=f"{HF_ASSETS}/config.json")
    return spec


# ----- HF -> Megatron ----------------------------------------------------------------------------------------
def run_conversion(prog: str, out_dir: Path, convert: Callable[[], str]) -> int:
    """A converter's command line around `convert` (which returns a summary): refuse to overwrite, time it,
    bad input as one line and exit 2, process group torn down."""
    from dapo_mcore.parallel import destroy_parallel

    if out_dir.exists():
        print(f"{prog}: {out_dir} exists; not overwriting it", file=sys.stderr)
        return 2
    start = time.perf_counter()
    # Megatron-Core's import notes (no Apex / TE on the CPU) were 8 lines above every error
    with quiet_save_reading():
        try:
            summary = convert()
        except DapoError as err:
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
        finally:
            destroy_parallel()
    print(f"wrote {out_dir}: {summary} in {time.perf_counter() - start:.1f} s")
    return 0


def hf_to_mcore(hf_dir: Path, out_dir: Path, dtype: str = "") -> dict[str, Any]:
    """Write HF_DIR's weights as a model-only distributed checkpoint in OUT_DIR (single process, CPU), stored
    at `dtype` ("": config.json's)."""
    from megatron.core import dist_checkpointing

    config = load_hf_config(str(hf_dir))
    spec = read_model_spec(config)  # names any unsupported HF config field
    dtype = dtype or str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"storage dtype {dtype!r} (from {hf_dir}/config.json?): use float32, bfloat16 or float16")
    ctx = init_parallel(1, 1, "cpu")
    chunks = build_model(spec, ctx, "float32")  # the CPU mode computes in fp32; storage takes `dtype`
    load_hf_weights(chunks, hf_dir, LlamaFamilyMap(spec), tp_rank=0, tp_size=1)  # checks every shape
    cast_parameters(chunks, getattr(torch, dtype))
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {
        "model": model_sharded_state_dict(chunks),
        "format": format_record("model", spec, chunks, {"tp": 1, "pp": 1}),
    }
    # the writer's results go through the queue that training's saves use (writer_processes.py): Megatron's own
    # manager would import torch to hold them, 4 of a conversion's 9 CPU-s
    from dapo_mcore.checkpoint.writer_processes import writer_results_queue_dies_with_us

    writer_results_queue_dies_with_us()
    dist_checkpointing.save(state, str(tmp), validate_access_integrity=False)
    copy_hf_assets(hf_dir, tmp)
    write_manifest(tmp)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir} appeared while converting; the result is left in {tmp}")
    tmp.rename(out_dir)
    params = sum(p.numel() for c in chunks for p in c.parameters())
    return {"parameters": params, "bytes": dir_bytes(out_dir), "dtype": dtype}


# ----- Megatron -> HF ----------------------------------------------------------------------------------------
def mcore_to_hf(ckpt: Path, out_dir: Path, dtype: str) -> dict[str, Any]:
    """Write a checkpoint's model (converted or run save) as safetensors + config + tokenizer in OUT_DIR;
    dtype "" keeps the stored one."""
    spec = spec_from_checkpoint(ckpt)
    dtype = dtype or read_format(ckpt).get("dtype", "float32")
    ctx = init_parallel(1, 1, "cpu")
    chunks = build_model(spec, ctx, "float32")
    load_model_weights(chunks, ckpt, spec, source=f"{HF_ASSETS}/config.json")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    writer = SafetensorsShardWriter(tmp)
    for name, tensor in full_hf_tensors(chunks, LlamaFamilyMap(spec)):
        writer.add(name, tensor.to(getattr(torch, dtype)))
    size = writer.close()
    write_hf_config(ckpt / HF_ASSETS, tmp, getattr(torch, dtype))
    tmp.rename(out_dir)
    return {"bytes": size, "dtype": dtype}


def full_hf_tensors(chunks: list[Any], family: LlamaFamilyMap) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of a TP=1 x PP=1 model (vocab padding removed), one parameter at a time."""
    for chunk in chunks:
        for name, param in global_named_parameters(chunk):  # no TP group: gather_full only cuts the padding
            full = gather_full(param.detach(), tp_split_of(name, param), None, family.spec.vocab_size)
            yield from family.mcore_to_hf(name, full)  # a tied output layer maps to nothing


# ----- the check ---------------------------------------------------------------------------------------------
@dataclass
class ConversionReport:
    logits_max_diff: float
    logprobs_max_diff: float
    tokens: int
    tp: int

    def passed(self, atol: float) -> bool:
        return self.logits_max_diff <= atol and self.logprobs_max_diff <= atol


def check_conversion(hf_dir: Path, ckpt: Path, tp: int, prompts: list[list[int]]) -> ConversionReport | None:
    """Run the HF model and the checkpoint's Megatron model (TP=tp, float32, CPU) on the same prompts.

    Logits come from Megatron's own output layer; log-probs of each prompt's second half come from the
    trainer's fused log-prob path (the numbers training uses). Returns the report on rank 0, None elsewhere.
    """
    from transformers import AutoModelForCausalLM

    spec = read_model_spec(load_hf_config(str(hf_dir)))
    check_model_spec(read_format(ckpt)["model_spec"], spec, ckpt, source=f"{hf_dir}/config.json")
    check_model_layout(spec, tp, 1, 1)
    ctx = init_parallel(tp, 1, "cpu")
    chunks = build_model(spec, ctx, "float32")
    load_model_weights(chunks, ckpt, spec, source=f"{hf_dir}/config.json")
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    logit_diff, logprob_diff = 0.0, 0.0
    mcore_logits = [_mcore_logits(ctx, spec, chunks, ids) for ids in prompts]
    mcore_logprobs = _mcore_logprobs(ctx, spec, chunks, prompts)  # after: this swaps in the fused head
    for ids, mc_logits, mcore_lp in zip(prompts, mcore_logits, mcore_logprobs):
        with torch.no_grad():
            hf_logits = hf_model(torch.tensor([ids])).logits[0].float()
        logit_diff = max(logit_diff, (mc_logits - hf_logits).abs().max().item())
        half = len(ids) // 2
        hf_lp = torch.log_softmax(hf_logits[half - 1 : -1], -1).gather(-1, torch.tensor(ids[half:])[:, None])
        logprob_diff = max(logprob_diff, (torch.tensor(mcore_lp) - hf_lp.squeeze(-1)).abs().max().item())
    return ConversionReport(logit_diff, logprob_diff, sum(map(len, prompts)), tp) if ctx.rank == 0 else None


@torch.no_grad()
def _mcore_logits(ctx: ParallelContext, spec: ModelSpec, chunks: list[Any], ids: list[int]) -> torch.Tensor:
    """[S, V] logits, gathered over the vocab-parallel TP ranks, padding columns cut."""
    local = chunks[0].eval()(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0]  # [S, V/tp]
    full = gather_full(local, TPSplit(dim=-1), ctx.pg.tp if ctx.tp_size > 1 else None, spec.vocab_size)
    return full[:, : spec.vocab_size].float()


def _mcore_logprobs(ctx: ParallelContext, spec: ModelSpec, chunks: list[Any], prompts: list[list[int]]) -> list:
    """Per-token log-probs of each prompt's second half given its first half, through the trainer's path."""
    from dapo_mcore.data.types import Sample
    from dapo_mcore.mcore.actor import ActorSettings, PolicyRunner

    runner = PolicyRunner(ctx, spec, chunks, ActorSettings(1, 1.0, pad_id=0))
    halves = [(ids[: len(ids) // 2], ids[len(ids) // 2 :]) for ids in prompts]
    samples = [Sample(prompt, response, [0.0] * len(response), "stop") for prompt, response in halves]
    runner.fill_logprobs(samples, [list(range(len(samples)))], "old_logprobs")
    return [s.old_logprobs for s in samples]


def default_prompts(hf_dir: Path, vocab_size: int) -> list[list[int]]:
    """A fixed prompt set: a few texts through the model's tokenizer (when it has one) and random ids."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (17, 64)]
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    except Exception as err:  # no tokenizer files: the random prompts still check every weight
        log.warning("no tokenizer in %s (%s); checking random token ids only", hf_dir, err)
        return prompts
    texts = ["Question: what is 17 + 25? Answer: 42", "The capital of France is Paris, and"]
    return [ids for ids in (tokenizer(t)["input_ids"] for t in texts) if len(ids) >= 4] + prompts
