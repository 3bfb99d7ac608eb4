"""The sampler's settings, read by the sampler and by its scoring (apart from both, so that neither imports the
other)."""

from __future__ import annotations

from dataclasses import dataclass

from dapo_mcore.config.schema import AlgorithmConfig, RolloutConfig

_ALGO = AlgorithmConfig()
_ROLLOUT = RolloutConfig()


@dataclass(frozen=True)
class SamplerSettings:
    n_samples_per_prompt: int
    prompts_per_step: int
    gen_prompts_per_round: int
    temperature: float
    top_p: float
    max_response_len: int
    seed: int
    # The defaults are the config schema's (one set of defaults: tests/unit/test_settings_defaults.py).
    reward_correct: float = _ALGO.reward.correct
    reward_wrong: float = _ALGO.reward.wrong
    adv_estimator: str = _ALGO.advantage.estimator
    adv_eps: float = _ALGO.advantage.eps
    adv_batch_normalize: bool = _ALGO.advantage.batch_normalize
    overlong_enabled: bool = _ALGO.overlong.enabled
    overlong_buffer_len: int = _ALGO.overlong.buffer_len
    overlong_penalty_factor: float = _ALGO.overlong.penalty_factor
    overlong_filter: bool = _ALGO.overlong.filter_truncated
    length_penalty: bool = _ALGO.length_penalty.enabled
    length_penalty_coef: float = _ALGO.length_penalty.coef
    length_penalty_safe_len: int = _ALGO.length_penalty.safe_len
    length_penalty_max_len: int = _ALGO.length_penalty.max_len
    dynamic_sampling: bool = _ALGO.dynamic_sampling.enabled
    carry_surplus: bool = _ROLLOUT.carry_surplus
    partial_rollout: bool = _ROLLOUT.partial_rollout
    partial_oversample: float = _ROLLOUT.partial_oversample
    partial_max_staleness: int = _ROLLOUT.partial_max_staleness
    mode: str = _ALGO.dynamic_sampling.mode
    max_rounds: int = _ALGO.dynamic_sampling.max_rounds
    on_cap: str = _ALGO.dynamic_sampling.on_cap
    adaptive: bool = _ALGO.dynamic_sampling.adaptive
    adaptive_min_prompts: int = _ALGO.dynamic_sampling.adaptive_min_prompts
    adaptive_max_prompts: int = _ALGO.dynamic_sampling.adaptive_max_prompts
