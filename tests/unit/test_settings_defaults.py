"""One set of defaults: every default of a component's settings that mirrors a config key is what the build
makes of the default config (config/schema.py holds the defaults; the settings take them from there)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dapo_mcore.algo.losses import LossSettings
from dapo_mcore.build import (
    actor_settings,
    engine_settings,
    eval_settings,
    loss_settings,
    optimizer_settings,
    sampler_settings,
)
from dapo_mcore.config import RunConfig
from dapo_mcore.mcore.actor import ActorSettings, OptimizerSettings
from dapo_mcore.rollout.base import EngineSettings
from dapo_mcore.rollout.sampler import SamplerSettings
from dapo_mcore.rollout.validation import EvalSettings

# Where the engine lives is resolved from the model and the tasks, not a knob: the defaults there are a
# standalone engine's on the CPU (EngineSettings' docstring).
# (instance_id names what the engine holds host-wide after the run directory: rollout/vllm_compat.py)
NOT_KNOBS = {EngineSettings: {"model_path", "device", "dtype", "load_weights", "placement", "instance_id"}}
ONE_PROCESS = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))


def built_from_the_default_config():
    cfg = RunConfig()
    return {
        LossSettings: loss_settings(cfg),
        SamplerSettings: sampler_settings(cfg),
        EngineSettings: engine_settings(cfg, ONE_PROCESS),
        ActorSettings: actor_settings(cfg, pad_id=0),
        OptimizerSettings: optimizer_settings(cfg),
        EvalSettings: eval_settings(cfg, n_replicas=1),
    }


@pytest.mark.parametrize(
    "cls", [LossSettings, SamplerSettings, EngineSettings, ActorSettings, OptimizerSettings, EvalSettings]
)
def test_every_default_is_the_config_schemas(cls):
    built = built_from_the_default_config()[cls]
    for field in dataclasses.fields(cls):
        if field.name in NOT_KNOBS.get(cls, set()):
            continue
        if field.default is not dataclasses.MISSING:
            assert field.default == getattr(built, field.name), f"{cls.__name__}.{field.name}"
        elif field.default_factory is not dataclasses.MISSING:
            assert field.default_factory() == getattr(built, field.name), f"{cls.__name__}.{field.name}"


def test_eval_commands_flag_defaults_are_validations():
    """`dapo-mcore eval` answers as the trainer's validation does unless told otherwise (no third copy)."""
    from dapo_mcore.cli import _parser

    args = _parser().parse_args(["eval", "model_dir", "--data", "aime.jsonl"])
    built = built_from_the_default_config()[EvalSettings]
    for name in ("k", "temperature", "top_p", "seed"):
        assert getattr(args, name) == getattr(built, name) == getattr(EvalSettings, name), name
