"""Each recipe of examples/ in miniature (dapo_mcore/rehearse/miniature.py): its exact combination of knobs on 2-4
gloo ranks with a tiny model of its family, generated from the recipe file itself, so that a change of the recipe
is a change of its test. Per recipe:

- the miniature sets nothing but what it shrinks (SHRUNK), and keeps each parallel dimension the recipe uses;
- run A: 2 steps, a save after each; every step's loss and gradient norm finite, an update made;
- run B: a copy of A without its step-2 save, resumed from the step-1 save: step 2's metrics (all but times and
  memory) and the saved state (weights, optimizer, RNG: the whole distributed checkpoint, but for the padding
  between parameters that Megatron writes from uninitialised memory) equal A's, bit for bit;
- where the layout has model or context parallelism (TP, PP, EP, CP), its layout-free reference (the same world as data
  parallelism alone: as many engine replicas, so the same rollouts) takes the same first step: the same rollouts,
  and loss, gradient norm and entropy to 1e-5 relative (DESIGN.md rule 10 on a whole run).

Miniatures that come out the same (the 7B and 32B recipes differ in TP 2 vs 8 and engine TP, both cut alike) share
their runs: the module runs whole on one worker (tests/conftest.py WHOLE_MODULES).
"""

from __future__ import annotations

import fnmatch
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dapo_mcore.config import load_config, validate
from dapo_mcore.config.loader import config_changes, config_to_dict
from dapo_mcore.rehearse.miniature import SHRUNK, Layout, Miniature, miniature, miniature_layout, recipe_model_config
from tests.conftest import REPO
from tests.e2e.test_checkpoints import without_timings
from tests.e2e.test_train_cli import cli, read_rows

EXAMPLES = REPO / "examples"
RECIPES = sorted(path.stem for path in EXAMPLES.glob("*.yaml"))
# Variants of a recipe, as a user would run it (overrides after the recipe), in miniature as the recipes are:
# the 7B recipe at context parallelism 2 (TP 2 + SP x CP 2 within the 4 ranks, DP 1; its reference DP 4)
VARIANTS = {"dapo_qwen2.5_7b_h100+cp2": ("dapo_qwen2.5_7b_h100", ("parallel.context_parallel_size=2",))}
CASES = [*RECIPES, *VARIANTS]
FINITE = ("loss/policy", "actor/grad_norm")
# The layout-free reference's first step: TP and EP sum in other orders (observed relative differences: loss 1e-7,
# gradient norm 4e-8, entropy 2e-6 at TP 2 + SP; at EP 2: 0, 2e-8, 1e-7)
REFERENCE_RTOL = 1e-5
CLOSE = ("loss/policy", "actor/grad_norm", "actor/entropy", "actor/ratio_mean")


def recipe_of(case: str) -> tuple[Path, tuple[str, ...]]:
    """A case's recipe file and the overrides that make it the case (none for a recipe as it is)."""
    recipe, extra = VARIANTS.get(case, (case, ()))
    return EXAMPLES / f"{recipe}.yaml", extra


def shrunk(case: str) -> tuple[Path, Miniature]:
    """The case's recipe file and its miniature, whose overrides (of the recipe file) include the variant's."""
    path, extra = recipe_of(case)
    cfg = load_config(path, list(extra))
    mini = miniature(cfg, recipe_model_config(cfg), case)
    return path, Miniature(mini.recipe, mini.layout, (*extra, *mini.overrides), mini.model)


@pytest.mark.parametrize("recipe", CASES)
def test_recipe_miniature_keeps_every_knob_it_does_not_shrink(recipe):
    path, mini = shrunk(recipe)
    cfg, small = load_config(path, list(recipe_of(recipe)[1])), load_config(path, mini.overrides)
    validate(small)
    changed = [key for key, _, _ in config_changes(config_to_dict(cfg), config_to_dict(small))]
    assert [key for key in changed if not any(fnmatch.fnmatchcase(key, p) for p in SHRUNK)] == []
    big, par = cfg.parallel, small.parallel
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "context_parallel_size",
    ):
        assert (getattr(par, name) > 1) == (getattr(big, name) > 1) and getattr(par, name) <= 2, name
    assert par.sequence_parallel == big.sequence_parallel and 2 <= mini.world <= 4
    assert (small.trainer.max_tokens_per_micro_batch > 0) == (cfg.trainer.max_tokens_per_micro_batch > 0)
    assert (mini.model.name == "tiny-arith-moe") == (recipe_of(recipe)[0].stem == "dapo_qwen3_30b_a3b_h100")


@pytest.mark.parametrize(
    "recipe_layout, layers, want",
    [
        (["parallel.pipeline_model_parallel_size=4", "parallel.virtual_pipeline_model_parallel_size=2"], 2,
         Layout(pp=2, vpp=1, dp=2)),  # the tiny models' 2 layers hold no virtual stages on PP 2
        (["parallel.pipeline_model_parallel_size=4", "parallel.virtual_pipeline_model_parallel_size=2"], 4,
         Layout(pp=2, vpp=2, dp=2)),
        (["parallel.tensor_model_parallel_size=4", "parallel.pipeline_model_parallel_size=2",
          "parallel.sequence_parallel=true"], 2, Layout(tp=2, pp=2, sp=True, dp=1)),  # within 4 ranks
        (["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=8"], 2,
         Layout(tp=2, ep=2, dp=2)),
        (["parallel.context_parallel_size=4"], 2, Layout(cp=2, dp=2)),
        (["parallel.tensor_model_parallel_size=8", "parallel.context_parallel_size=4",
          "parallel.sequence_parallel=true"], 2, Layout(tp=2, sp=True, cp=2, dp=1)),  # within 4 ranks
    ],
)  # fmt: skip
def test_a_miniature_layout_cuts_each_parallel_dimension_to_two_within_four_ranks(recipe_layout, layers, want):
    """The recipes use TP, SP and EP; PP, VPP and CP, as a recipe would set them, are cut alike."""
    assert miniature_layout(load_config(EXAMPLES / "dapo_paper.yaml", recipe_layout), layers) == want
    assert want.without_model_parallelism() == Layout(dp=want.world)


@dataclass
class Runs:
    straight: Path  # A: 2 steps, saving after each
    resumed: Path  # B: A's copy resumed from the step-1 save
    resumed_log: str
    reference: Path | None  # the layout-free first step


@pytest.fixture(scope="module")
def miniature_runs(tmp_path_factory):
    """The runs of each distinct miniature (by its resolved config, the recipe's name aside), made on first use."""
    root, made = tmp_path_factory.mktemp("miniatures"), {}

    def runs_of(path: Path, mini: Miniature) -> Runs:
        resolved = config_to_dict(load_config(path, mini.overrides))
        resolved.pop("name")
        key = json.dumps(resolved, sort_keys=True)
        if key not in made:
            made[key] = _make_runs(path, mini, root / f"{len(made)}-{mini.recipe}")
        return made[key]

    return runs_of


def _train(path: Path, overrides, run_dir: Path, world: int, *extra: str):
    return cli("train", str(path), *overrides, f"logging.run_dir={run_dir}", *extra, ranks=world)


def _make_runs(path: Path, mini: Miniature, root: Path) -> Runs:
    straight, resumed = root / "straight", root / "resumed"
    _train(path, mini.overrides, straight, mini.world)
    # B: the run as it was after step 1 (its step-2 save left out), continued from that save
    shutil.copytree(straight, resumed, ignore=lambda d, names: ["step_000002"] if d.endswith("checkpoints") else [])
    save = resumed / "checkpoints" / "step_000001"
    log = _train(path, mini.overrides, resumed, mini.world, f"checkpoint.resume={save}").stderr
    reference = None
    if (layout_free := mini.reference_overrides()) is not None:
        reference = root / "reference"
        _train(path, layout_free, reference, mini.world, "trainer.steps=1", "checkpoint.save_interval=0")
    return Runs(straight, resumed, log, reference)


def saved_state(save: Path) -> dict[str, object]:
    """Everything a distributed checkpoint holds (weights, optimizer state, RNG states), read in this one process,
    by key; the distributed optimizer's padding between parameters zeroed (padding_spans)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    reader = FileSystemReader(save)
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    for key, spans in padding_spans(reader.read_metadata()).items():
        for start, end in spans:
            state[key][start:end] = 0
    return state


# Megatron-Core's buffers start each parameter at a multiple of 64 values under the distributed optimizer
# (distributed/param_and_grad_buffer.py, _pad_start_of_param_if_needed), and its dp_reshardable save writes the gap
# after a parameter that ends elsewhere as a chunk of its own, taken from torch.empty (optimizer/distrib_optimizer.py,
# sharded_param_state_dp_reshardable): whatever memory held, different in every run, and never read back.
PARAM_ALIGNMENT = 64


def padding_spans(metadata) -> dict[str, list[tuple[int, int]]]:
    """Per optimizer bucket in a save's metadata, the chunks that are such padding: those that start off the
    alignment (a parameter starts on it; at DP 2 so does each rank's share of a bucket). Each is shorter than the
    alignment, or the assumption no longer holds and the test says so."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if ".optimizer.distributed." not in key or not getattr(meta, "chunks", None):
            continue
        for chunk in meta.chunks:
            (start,), (size,) = chunk.offsets, chunk.sizes
            if start % PARAM_ALIGNMENT:
                assert size < PARAM_ALIGNMENT, f"{key}: a chunk at {start} of {size} values is not alignment padding"
                spans.setdefault(key, []).append((start, start + size))
    return spans


def assert_same(got, want, where: str = "") -> int:
    """got == want, tensors bit for bit, through dicts, lists and tuples; returns the tensors compared."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
        return 1
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        return sum(assert_same(got[k], want[k], f"{where}.{k}") for k in want)
    if isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        return sum(assert_same(g, w, f"{where}[{i}]") for i, (g, w) in enumerate(zip(got, want)))
    assert got == want, where
    return 0


def _finite(row: dict, key: str) -> bool:
    # metrics.jsonl writes a non-finite value as null (utils/metrics_log.py)
    return isinstance(row.get(key), int | float) and math.isfinite(row[key])


@pytest.mark.parametrize("recipe", CASES)
def test_recipe_in_miniature(recipe, miniature_runs):
    path, mini = shrunk(recipe)
    runs = miniature_runs(path, mini)
    straight = read_rows(runs.straight)
    assert [row["step"] for row in straight] == [1, 2]
    for row in straight:
        assert row["actor/updates"] > 0 and all(_finite(row, key) for key in FINITE), row
    # the layout ran as shrunk
    ran, want_layout = load_config(runs.straight / "config.yaml").parallel, mini.layout
    ran_layout = (ran.tensor_model_parallel_size, ran.pipeline_model_parallel_size, ran.expert_model_parallel_size,
                  ran.context_parallel_size)  # fmt: skip
    assert ran_layout == (want_layout.tp, want_layout.pp, want_layout.ep, want_layout.cp)
    if want_layout.ep > 1:
        assert all(_finite(row, "router/aux_loss") for row in straight)
    # exact resume: from the step-1 save, step 2 as in the straight run, and the same state saved after it
    assert "step_000001 at step 1" in runs.resumed_log, runs.resumed_log[-3000:]
    assert without_timings(read_rows(runs.resumed)) == without_timings(straight)
    got = saved_state(runs.resumed / "checkpoints" / "step_000002")
    assert assert_same(got, saved_state(runs.straight / "checkpoints" / "step_000002")) > 0
    if runs.reference is None:
        return
    (first,) = read_rows(runs.reference)
    want = straight[0]
    for key in want:
        if key.startswith(("rollout/", "dynamic_sampling/", "reward/")):
            assert first[key] == want[key], key
    for key in CLOSE:
        assert first[key] == pytest.approx(want[key], rel=REFERENCE_RTOL), key
