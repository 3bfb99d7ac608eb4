#!/usr/bin/env python
"""Build the demo's tiny Llama model: examples/models/tiny-arith (config, safetensors, char tokenizer).

The model is supervised on arithmetic prompts with the right sums, but with two habits a base model often
has: only a fraction (--p-answer-format) of its answers use the "Answer: N" form the DAPO verifier reads
(the rest say "Result: N"), and answers come after 0..--max-filler filler words ("hmm, "), so the longest
ones run past the demo's 32-token limit. It starts where RL can help: sampled accuracy about 0.2, groups
with 0 < accuracy < 1 for dynamic sampling, and responses in the overlong zone for the length penalty.
DAPO has to find the accepted format and shorter answers from rewards alone.

    python tools/make_tiny_model.py --out examples/models/tiny-arith

The long-tail variant for the partial-rollout benchmark (tools/bench_rollout.py --long-tail): one answer in
eight runs on with 12..40 filler words (60-200 tokens) instead of 0..5, as the longest chains of thought do:

    python tools/make_tiny_model.py --out examples/models/tiny-arith-longtail --long-tail 0.125:12:40 \
        --max-positions 256 --steps 1000 --eval-every 250
The mixture-of-experts variant (a Qwen3-MoE: Qwen3 attention, 8 experts of width 64, top-2, renormalised):
    python tools/make_tiny_model.py --out examples/models/tiny-arith-moe --moe 8:2:64 --steps 2000
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.tokenizer import build_char_tokenizer
from dapo_mcore.rewards.dapo_rule import is_correct

FILLER = "hmm, "


def sft_text(
    prompt: str, answer: str, rng: random.Random, p_answer_format: float, max_filler: int, long_tail=None
) -> str:
    """long_tail (p, lo, hi): with probability p the answer takes lo..hi filler words instead of 0..max_filler."""
    label = "Answer" if rng.random() < p_answer_format else "Result"
    fillers = rng.randint(0, max_filler)
    if long_tail and rng.random() < long_tail[0]:
        fillers = rng.randint(long_tail[1], long_tail[2])
    return prompt + FILLER * fillers + f"{label}: {answer}"


def build_model(
    vocab_size: int, hidden: int, layers: int, head_dim: int, tokenizer, max_positions: int = 128, moe: str = ""
):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        # vLLM's CPU attention kernels take head sizes of 32 and up, so the demo runs on every engine.
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if not moe:
        return LlamaForCausalLM(LlamaConfig(**common))
    experts, topk, expert_ffn = (int(x) for x in moe.split(":"))
    config = Qwen3MoeConfig(
        num_experts=experts,
        num_experts_per_tok=topk,
        moe_intermediate_size=expert_ffn,
        norm_topk_prob=True,  # as Qwen3-30B-A3B
        router_aux_loss_coef=0.001,
        **common,
    )
    return Qwen3MoeForCausalLM(config)


def batch_tensors(texts: list[str], prompts: list[str], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer(t).input_ids + [tokenizer.eos_token_id] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        ids[i, : len(row)] = torch.tensor(row)
        n_prompt = len(tokenizer(prompt).input_ids)
        labels[i, n_prompt : len(row)] = torch.tensor(row[n_prompt:])  # learn the response only
    return ids, labels


@torch.no_grad()
def sampled_accuracy(model, tokenizer, task: ArithmeticTask, n_prompts: int, rng: random.Random) -> float:
    from dapo_mcore.rollout.base import SamplingParams
    from dapo_mcore.rollout.hf_engine import HFEngine

    engine = HFEngine(model, tokenizer, max_batch_rows=512)
    prompts = [task[rng.randrange(len(task))] for _ in range(n_prompts)]
    outs = engine.generate([tokenizer(p.text).input_ids for p in prompts], SamplingParams(n=8, max_new_tokens=32))
    model.train()
    return sum(is_correct(c.text, p.answer) for p, cs in zip(prompts, outs) for c in cs) / (8 * n_prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="examples/models/tiny-arith")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--max-operand", type=int, default=29)
    ap.add_argument("--p-answer-format", type=float, default=0.4)
    ap.add_argument("--max-filler", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--long-tail", default="", help="P:LO:HI: with probability P, LO..HI filler words")
    ap.add_argument("--max-positions", type=int, default=128)
    ap.add_argument("--moe", default="", help="EXPERTS:TOPK:FFN: a Qwen3-MoE with that many experts of that width")
    args = ap.parse_args()
    long_tail = None
    if args.long_tail:
        p, lo, hi = args.long_tail.split(":")
        long_tail = (float(p), int(lo), int(hi))

    from transformers import AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    task = ArithmeticTask(0, args.max_operand, "+")
    model = build_model(
        len(tokenizer), args.hidden, args.layers, args.head_dim, tokenizer, args.max_positions, args.moe
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    start = time.time()
    for step in range(args.steps):
        problems = [task[rng.randrange(len(task))] for _ in range(args.batch)]
        texts = [sft_text(p.text, p.answer, rng, args.p_answer_format, args.max_filler, long_tail) for p in problems]
        ids, labels = batch_tensors(texts, [p.text for p in problems], tokenizer)
        # a MoE's load-balancing loss joins the SFT loss (its experts would otherwise collapse onto a few)
        extra = {"output_router_logits": True} if args.moe else {}
        loss = model(input_ids=ids, labels=labels, **extra).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad()
        if step % args.eval_every == 0 or step == args.steps - 1:
            acc = sampled_accuracy(model, tokenizer, task, 64, rng)
            print(f"step {step}: loss {loss.item():.4f} sampled accuracy {acc:.3f} ({time.time() - start:.0f}s)")
    model.save_pretrained(out, safe_serialization=True)
    print(f"saved {out} ({sum(p.numel() for p in model.parameters())} parameters)")


if __name__ == "__main__":
    main()
