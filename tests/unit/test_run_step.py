"""One run built in this process (the demo recipe, a few steps): the engine starts before the actor allocates,
the step's micro-batches are gone before the weight push, and a push that corrupts a weight stops the run."""

from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path

import pytest

from dapo_mcore import build, trainer
from dapo_mcore.config import load_config
from dapo_mcore.utils.errors import MismatchError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the run, the order in which its pieces were made)."""
    events: list[str] = []
    with pytest.MonkeyPatch.context() as patch:

        def create_engine(name, settings, create=build.create_engine):
            engine = create(name, settings)
            events.append("engine started")
            release = engine.release_memory
            engine.release_memory = lambda: (events.append("engine released"), release())[-1]
            return engine

        def recorded(fn, event):
            return lambda *args, **kwargs: (events.append(event), fn(*args, **kwargs))[-1]

        patch.setattr(build, "create_engine", create_engine)
        patch.setattr(build, "load_policy_chunks", recorded(build.load_policy_chunks, "policy loaded"))
        patch.setattr(build, "build_actor", recorded(build.build_actor, "actor built"))
        cfg = load_config(
            REPO / "examples/smoke_cpu.yaml",
            [
                f"logging.run_dir={tmp_path_factory.mktemp('run')}",
                "logging.progress=false",
                "logging.wandb.mode=disabled",
                "logging.plot=false",
                "checkpoint.save_interval=0",
                "trainer.steps=4",
            ],
        )
        run = build.build_run(cfg)
    try:
        trainer.push_weights(run, first=True)
        yield run, events
    finally:
        trainer.finish(run)


def test_the_engine_starts_and_sleeps_before_the_actor_allocates(built):
    """vLLM refuses to start unless its share of the GPU is free: started after the actor's gradient buffers and
    optimizer state, the 30B-A3B recipe's engine would find 35 of the 47.5 GiB it asks."""
    _, events = built
    assert events == ["engine started", "engine released", "policy loaded", "actor built"]


def test_the_step_batch_is_released_before_the_weight_push(built, monkeypatch):
    """The micro-batches the old log-probs and the update read (on the device) are gone, and the cache handed
    back, when the push wakes the engine's weights beside the actor."""
    run, _ = built
    alive: list[weakref.ref] = []
    seen_at_push: list[bool] = []
    prepare = run.actor.prepare

    def recording_prepare(samples, mini_batches):
        batches = prepare(samples, mini_batches)
        alive.append(weakref.ref(batches))
        return batches

    def push(run, first=False, real=trainer.push_weights):
        gc.collect()
        seen_at_push.append(all(ref() is None for ref in alive))
        return real(run, first)

    def release(device):  # on a GPU: the freed blocks back to the driver, where the waking engine finds them
        seen_at_push.append("released")

    monkeypatch.setattr(run.actor, "prepare", recording_prepare)
    monkeypatch.setattr(trainer, "push_weights", push)
    monkeypatch.setattr(trainer, "release_cached_blocks", release)
    metrics = trainer.rl_step(run, 0)
    assert alive and seen_at_push == ["released", True]
    assert metrics["mismatch/abs_logp_diff_mean"] < 1e-3  # the fp32 CPU engine computes what the actor does


def gate_and_up_swapped(named_tensors):
    """A weight-name mapping bug: layer 0's gate and up projections each sent under the other's name."""
    gate = "model.layers.0.mlp.gate_proj.weight"
    held = None
    for name, tensor in named_tensors:
        if name == gate:
            held = tensor
        elif name == "model.layers.0.mlp.up_proj.weight":
            yield from ((gate, tensor), (name, held))
        else:
            yield name, tensor


def test_a_push_that_corrupts_one_tensor_is_stopped_by_the_guard(built, monkeypatch):
    """The engine generates with a damaged weight: the KL between its log-probs of its own answers and the
    actor's is over a nat a token (1.4 seen), and the step stops with one line naming the step and the gap."""
    run, _ = built
    update = run.engine.update_weights
    monkeypatch.setattr(run.engine, "update_weights", lambda named: update(gate_and_up_swapped(named)))
    trainer.push_weights(run)
    with pytest.raises(MismatchError, match=r"step 2: .* far from the actor's: KL\(engine \|\| actor\) [\d.]+ nats"):
        trainer.rl_step(run, 1)  # the update after one: step 2
    monkeypatch.undo()
    trainer.push_weights(run)  # the run's own weights back in the engine


def test_the_guard_warns_or_stays_quiet_as_configured(built, caplog):
    run, _ = built
    cfg = run.cfg
    metrics = {"mismatch/k3_kl": 1.5, "mismatch/abs_logp_diff_mean": 1.2}
    cfg.algorithm.mismatch.guard = "warn"
    with caplog.at_level("WARNING", logger="dapo_mcore"):
        trainer.check_mismatch(cfg, 7, metrics)
    assert "step 7" in caplog.text and "training on (algorithm.mismatch.guard=warn)" in caplog.text
    cfg.algorithm.mismatch.guard = "off"
    trainer.check_mismatch(cfg, 7, metrics)
    cfg.algorithm.mismatch.guard = "stop"
    trainer.check_mismatch(cfg, 7, {"mismatch/k3_kl": 0.05, "mismatch/abs_logp_diff_mean": 0.2})  # below 0.1
    trainer.check_mismatch(cfg, 7, {})  # no answer of this step's weights: nothing to compare
    with pytest.raises(MismatchError, match="step 7"):
        trainer.check_mismatch(cfg, 7, metrics)
    nan = {"mismatch/k3_kl": math.nan, "mismatch/abs_logp_diff_mean": math.nan}
    with pytest.raises(MismatchError, match=r"step 7: a log-prob .* is not a number \(NaN\)"):
        trainer.check_mismatch(cfg, 7, nan)


def test_the_runs_first_push_is_verified(built, caplog, monkeypatch):
    run, _ = built
    with caplog.at_level("INFO", logger="dapo_mcore"):
        assert trainer.push_weights(run, first=True)["weight_sync/verified_tensors"] > 0
        assert trainer.push_weights(run) == {}  # later pushes: the guard watches them
    assert "weight push verified" in caplog.text
