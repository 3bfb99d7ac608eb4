"""Named override sets: DAPO with one component removed at a time, and plain GRPO (the paper's baseline).

Used by tools/ablation.py and by the test that runs the smoke recipe with each component off.
"""

from __future__ import annotations

# Each DAPO component and the overrides that switch it off (back to what GRPO does).
COMPONENTS_OFF: dict[str, list[str]] = {
    "clip_higher": ["algorithm.clip_high=0.2"],  # symmetric clip, eps = 0.2
    "token_level_loss": ["algorithm.loss_agg=seq-mean-token-mean"],  # GRPO's per-sequence mean
    "dynamic_sampling": ["algorithm.dynamic_sampling.enabled=false"],
    "overlong_shaping": ["algorithm.overlong.enabled=false"],
    "dual_clip": ["algorithm.dual_clip_c=null"],
}

ABLATIONS: dict[str, list[str]] = {
    "dapo": [],
    "grpo": [override for name in COMPONENTS_OFF for override in COMPONENTS_OFF[name]],
    **{f"no_{name}": overrides for name, overrides in COMPONENTS_OFF.items()},
}

# Not ablations: DAPO with its rollout changed (tools/ablation.py --variants ...; docs/partial_rollout.md).
ROLLOUT_VARIANTS: dict[str, list[str]] = {
    "partial_rollout": ["rollout.partial_rollout=true", "rollout.partial_oversample=2"],
    "partial_rollout_tis": [
        "rollout.partial_rollout=true",
        "rollout.partial_oversample=2",
        "algorithm.mismatch.tis=token",
    ],
}

# Not ablations either: DAPO's recipe with another policy loss (algorithm.policy_loss, at that loss's own default
# settings; docs/algorithm.md).
LOSS_VARIANTS: dict[str, list[str]] = {
    "gspo": ["algorithm.policy_loss=gspo"],
    "cispo": ["algorithm.policy_loss=cispo"],
    "sapo": ["algorithm.policy_loss=sapo"],
}
