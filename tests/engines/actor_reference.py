"""The actor's side of the engine contract (run under torchrun, 1 process): the Megatron-Core policy built
from an HF directory decodes prompts greedily and recomputes the log-probs of given completions.

    torchrun --nproc_per_node 1 actor_reference.py HF_DIR IN.pt OUT.pt

IN.pt: {"prompts": [[ids]], "max_new_tokens": int, "samples": [(prompt_ids, response_ids)]}
OUT.pt: {"greedy": [[ids]] (stopping after an end-of-sequence id, kept), "logprobs": [[float]]}
"""

import sys

import torch

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.checkpoint.hf_io import load_hf_weights
from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.data.types import Sample
from dapo_mcore.mcore.actor import ActorSettings, build_reference
from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config
from dapo_mcore.parallel import destroy_parallel, init_parallel
from dapo_mcore.rollout.model_info import stop_token_ids


@torch.no_grad()
def greedy(model, prompt: list[int], max_new: int, stops: list[int], vocab: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new):
        tokens = torch.tensor([ids])
        logits = model(input_ids=tokens, position_ids=torch.arange(len(ids))[None], attention_mask=None)
        ids.append(int(logits[0, -1, :vocab].argmax()))
        if ids[-1] in stops:
            break
    return ids[len(prompt) :]


def main():
    hf_dir, inp, out = sys.argv[1:4]
    job = torch.load(inp)
    ctx = init_parallel(1, 1, "cpu")
    spec = read_model_spec(load_hf_config(hf_dir))
    config = build_transformer_config(spec, tp=1, pp=1, dtype="float32", on_cpu=True, use_te=False)
    chunks = build_gpt_chunks(spec, config, ctx=ctx, use_te=False)
    load_hf_weights(chunks, hf_dir, LlamaFamilyMap(spec), 0, 1)
    stops = stop_token_ids(hf_dir, None)
    # Greedy decoding from the plain model's logits, before the policy runner sets up its fused log-prob head.
    gpt = chunks[0].eval()
    result = {"greedy": [greedy(gpt, p, job["max_new_tokens"], stops, spec.vocab_size) for p in job["prompts"]]}
    settings = ActorSettings(micro_batch_size=8, temperature=1.0, pad_id=0, fused_logprobs=True)
    policy = build_reference(ctx, spec, chunks, settings)
    samples = [
        Sample(prompt_ids=p, response_ids=r, rollout_logprobs=[0.0] * len(r), finish_reason="stop")
        for p, r in job["samples"]
    ]
    policy.fill_logprobs(samples, [list(range(len(samples)))], "old_logprobs")
    result["logprobs"] = [s.old_logprobs for s in samples]
    torch.save(result, out)
    destroy_parallel()


if __name__ == "__main__":
    main()
