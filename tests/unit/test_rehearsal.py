"""The rehearsal's parts on one process: its counts and shrunk model (rehearse/setup.py), what it counts of each
collective and of the live objects (probes.py), how the report judges growth (report.py). The whole command
runs in tests/dist/test_rehearsal.py."""

from __future__ import annotations

import json
import mmap

import pytest
import torch

from dapo_mcore.config import load_config, validate
from dapo_mcore.rehearse import probes
from dapo_mcore.rehearse.report import Growth, fit, growth_table
from dapo_mcore.rehearse.setup import RecipeShape, full_counts, per_rank_counts, rehearsal_overrides, shrink_model
from dapo_mcore.utils.errors import ConfigError
from dapo_mcore.utils.timers import PhaseTimer, observing, phase_scope
from tests.conftest import REPO

RECIPE_32B = REPO / "examples/dapo_qwen2.5_32b_h100.yaml"
RECIPE_7B = REPO / "examples/dapo_qwen2.5_7b_h100.yaml"
MOE_CONFIG = REPO / "examples/models/Qwen3-30B-A3B/config.json"


def test_a_per_rank_process_carries_one_recipe_ranks_share_at_every_world_size():
    shape = RecipeShape.of(load_config(RECIPE_32B), gpus=32)
    assert (shape.dp, shape.replicas, shape.updates_per_step) == (4, 4, 16)  # TP 8, engine TP 8
    for world in (2, 4, 8):
        counts = per_rank_counts(shape, world, load=1.0)
        # a rank of the 32-GPU job trains 512 / 4 prompts a step; its replica generates 1536 / 4 a round, and so
        # does the rehearsal's one replica (engine TP gcd(8, world)), at least the prompts its ranks train
        assert shape.engine_tp_at(world) == world
        assert counts.prompts_per_step == world * 128 and counts.prompts_per_round == max(384, world * 128)
        assert counts.prompts_per_step * 16 // counts.mini_batch_size == 16  # the recipe's updates a step
    assert per_rank_counts(shape, 2, load=0.25).prompts_per_step == 2 * 32
    assert full_counts(shape, 2).prompts_per_step == 512 and full_counts(shape, 2).prompts_per_round == 1536


def test_a_context_parallel_recipe_is_rehearsed_at_cp_2_with_one_dp_ranks_share_a_pair():
    shape = RecipeShape.of(load_config(RECIPE_7B, ["parallel.context_parallel_size=4"]), gpus=16)
    assert (shape.dp, shape.context_parallel) == (2, 4)  # TP 2 x CP 4 x DP 2
    assert [shape.context_parallel_at(world) for world in (2, 3, 4, 8)] == [2, 1, 2, 2]
    for world in (2, 4, 8):
        # a DP rank of the job trains 512 / 2 prompts a step; the rehearsal's world / 2 DP ranks each as much
        assert per_rank_counts(shape, world, load=1.0).prompts_per_step == world // 2 * 256
    with pytest.raises(ConfigError, match=r"TP x PP x CP \(8\)"):
        RecipeShape.of(load_config(RECIPE_7B, ["parallel.context_parallel_size=4"]), gpus=12)
    assert RecipeShape.of(load_config(RECIPE_7B), gpus=8).context_parallel_at(2) == 1


def test_a_world_that_the_layout_does_not_divide_is_refused():
    with pytest.raises(ConfigError, match="--gpus 12 is not a multiple of the recipe's TP x PP"):
        RecipeShape.of(load_config(RECIPE_32B), gpus=12)


def test_the_shrunk_model_keeps_vocabulary_experts_and_top_k_and_cuts_the_compute(tmp_path):
    hf = json.loads(MOE_CONFIG.read_text())
    out = shrink_model(hf, tmp_path / "model", positions=22528)
    shrunk = json.loads((out / "config.json").read_text())
    kept = ("vocab_size", "num_experts", "num_experts_per_tok", "model_type")
    assert {k: shrunk[k] for k in kept} == {k: hf[k] for k in kept}
    assert (shrunk["hidden_size"], shrunk["num_hidden_layers"], shrunk["head_dim"]) == (64, 2, 16)
    assert shrunk["max_position_embeddings"] == 40960 and shrunk["eos_token_id"] == 2  # the demo tokenizer's
    assert (out / "tokenizer.json").is_file()


def test_the_rehearsal_config_loads_over_a_recipe(tmp_path):
    shape = RecipeShape.of(load_config(RECIPE_32B), gpus=32)
    model = shrink_model(json.loads((REPO / "examples/models/Qwen2.5-32B/config.json").read_text()), tmp_path / "m")
    overrides = rehearsal_overrides(per_rank_counts(shape, 2, 0.1), model, tmp_path / "run", 8192, 2, 1)
    cfg = load_config(RECIPE_32B, overrides)
    validate(cfg)
    assert (cfg.rollout.engine, cfg.parallel.tensor_model_parallel_size, cfg.trainer.rehearsal_micro_batches) == (
        "synthetic",
        1,
        1,
    )
    assert cfg.rollout.synthetic.mean_len_first == cfg.rollout.synthetic.mean_len_last == 8192


def test_rehearsal_micro_batches_are_refused_outside_a_rehearsal():
    with pytest.raises(ConfigError, match="trainer.rehearsal_micro_batches leaves most of a step untrained"):
        validate(load_config(REPO / "examples/smoke_cpu.yaml", ["trainer.rehearsal_micro_batches=1"]))


@pytest.mark.parametrize(
    "name, arguments, expected",
    [
        ("all_reduce", {"tensor": torch.zeros(10)}, (40, 40)),
        ("all_gather", {"tensor_list": [torch.zeros(3)] * 4, "tensor": torch.zeros(3)}, (12, 48)),
        ("all_gather_into_tensor", {"output_tensor": torch.zeros(40), "input_tensor": torch.zeros(10)}, (40, 160)),
        ("reduce_scatter_tensor", {"output": torch.zeros(10), "input": torch.zeros(40)}, (160, 40)),
        ("all_to_all_single", {"output": torch.zeros(7), "input": torch.zeros(5)}, (20, 28)),
        ("broadcast", {"tensor": torch.zeros(2), "src": 3}, (0, 8)),
        ("broadcast", {"tensor": torch.zeros(2), "src": 0}, (8, 0)),
    ],
)
def test_each_collective_counts_the_buffers_it_reads_and_writes_on_this_rank(monkeypatch, name, arguments, expected):
    """A collective over a fixed tensor stays flat as ranks are added; a gather's output grows with them."""
    monkeypatch.setattr(probes, "_group_rank_size", lambda group: (0, 4))
    monkeypatch.setattr(probes.dist, "get_rank", lambda: 0)
    assert probes._payload(name, arguments) == expected


def test_the_counter_wraps_the_collectives_and_gives_them_back():
    original = torch.distributed.all_reduce
    counter = probes.ByteCounter().install()
    try:
        assert torch.distributed.all_reduce is not original and torch.distributed.all_reduce.__wrapped__ is original
    finally:
        counter.uninstall()
    assert torch.distributed.all_reduce is original


def test_a_collective_that_calls_its_public_name_again_is_counted_once(monkeypatch):
    """The CPU device mode's __torch_function__ calls the public name (the counter's wrapper) again from inside
    the collective: every exchange of the rehearsals was counted twice."""
    monkeypatch.setattr(probes, "_group_rank_size", lambda group: (0, 4))
    counter = probes.ByteCounter()
    calls = []

    def all_reduce(tensor, op=None, group=None, async_op=False):  # torch's signature, as the device mode calls it
        calls.append(tensor.numel())
        if len(calls) == 1:
            counted(tensor)

    counted = counter._wrap("all_reduce", all_reduce)
    counted(torch.zeros(10))
    assert calls == [10, 10] and (counter.sent, counter.received) == (40, 40)
    counted(torch.zeros(5))
    assert (counter.sent, counter.received) == (60, 60)


def test_the_census_finds_the_largest_tensor_and_names_what_holds_it():
    class Holder:
        pass

    holder = Holder()
    holder.big_tensor = torch.zeros(3_000_000)
    holder.long_list = list(range(3_000_000))
    found = probes.census()
    largest, longest = found["largest_tensors"][0], found["longest_containers"][0]
    assert largest["bytes"] == 12_000_000 and largest["held_by"] == "Holder.big_tensor"
    assert longest["len"] == 3_000_000 and longest["held_by"] == "Holder.long_list"
    holder.nested = {"buffers": [torch.zeros(4_000_000)]}  # a holder's dict of lists: named down the path
    assert probes.census()["largest_tensors"][0]["held_by"] == "Holder.nested['buffers'][0]"


def test_the_census_passes_over_fake_tensors_that_hold_no_memory():
    """torch.compile leaves fake tensors alive (a suite run met one another test made): they refuse data_ptr."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(5_000_000)
    found = probes.census()
    assert all(entry["bytes"] < 20_000_000 for entry in found["largest_tensors"]), found
    del fake


def test_a_probe_records_each_phase_with_its_own_peak_and_the_parents_includes_it(tmp_path):
    probe = probes.RankProbe(tmp_path / "rank0.jsonl", probes.ByteCounter(), census_phases=False)
    timer = PhaseTimer()
    with observing(probe), phase_scope("step"):
        with timer.phase("generate"):
            # 200 MB, touched, then handed back to the kernel: an anonymous mapping of its own (a bytearray comes
            # from malloc, which in a suite worker whose earlier tests moved malloc's thresholds stayed resident,
            # so the next phase's peak, reset at its start, counted it too)
            held = mmap.mmap(-1, 200 * 2**20)
            for offset in range(0, len(held), 4096):
                held[offset] = 1
            held.close()
        with timer.phase("update"):
            pass
    probe.finish()
    records = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    exits = {r["phase"]: r for r in records if r["event"] == "exit"}
    assert [r["phase"] for r in records if r["event"] == "enter"] == ["step", "generate", "update"]
    assert exits["generate"]["peak_rss_mb"] > exits["update"]["peak_rss_mb"] + 150
    assert exits["step"]["peak_rss_mb"] >= exits["generate"]["peak_rss_mb"]
    assert records[-1]["event"] == "process" and records[-1]["peak_rss_mb"] >= exits["generate"]["peak_rss_mb"]
    assert timer.pop().keys() == {"time/generate_s", "time/update_s"}


def test_the_fit_and_projection_of_a_quantity_that_grows_with_the_ranks():
    assert fit([2, 4, 8], [3.0, 5.0, 9.0]) == pytest.approx((1.0, 1.0))
    growth = Growth("exchange", "received MB", [2, 4, 8], [3.0, 5.0, 9.0], 1.0, 33.0, True)
    assert growth.projected == 1.0 + 1.0 * 32


class _World:
    def __init__(self, n, received, kept_tokens=0.0):
        self.n, self.received, self.kept_tokens = n, received, kept_tokens

    def kept_tokens_per_rank(self, step=None):
        return self.kept_tokens / self.n

    def phases(self, step=None):
        from dapo_mcore.rehearse.report import PhaseFigures

        figures = {"received_mb": self.received, "peak_rss_mb": 500.0}
        return {"exchange": PhaseFigures(values=figures, mean=figures)}


def test_growth_is_named_past_its_tolerance_and_floor_and_not_below():
    flat = growth_table([_World(2, 1.0), _World(4, 1.02), _World(8, 1.05)], project_to=64)
    assert not [g for g in flat if g.grows]
    doubling = growth_table([_World(2, 1.0), _World(4, 2.0), _World(8, 4.0)], project_to=64)
    received = next(g for g in doubling if g.quantity == "received MB")
    assert received.grows and received.projected == pytest.approx(received.slope * 64 + (4.0 - received.slope * 8))
    tiny = growth_table([_World(2, 0.001), _World(4, 0.002)], project_to=64)  # doubles, but below 64 KB
    assert not [g for g in tiny if g.grows]


def test_exchanged_bytes_are_judged_per_kept_token_where_the_runs_recorded_them():
    """A rank that happened to keep 25% longer answers receives 25% more: not a growth with the ranks. Twice
    the bytes for the same kept tokens still is."""
    drawn = growth_table([_World(2, 4.0, 2e5), _World(4, 4.6, 4.6e5), _World(8, 5.0, 1e6)], project_to=64)
    received = next(g for g in drawn if g.quantity.startswith("received MB"))
    assert "per kept token" in received.quantity and not received.grows
    assert received.values == pytest.approx([4.0, 4.0, 4.0])
    doubling = growth_table([_World(2, 4.0, 2e5), _World(4, 8.0, 4e5), _World(8, 16.0, 8e5)], project_to=64)
    assert next(g for g in doubling if g.quantity.startswith("received MB")).grows


def test_a_rehearsals_computed_micro_batch_is_its_first_rows_and_positions():
    """trainer.rehearsal_micro_batches: the actor computes a view of the micro-batch within 4096 tokens and 1024
    positions a row, whatever lengths were drawn (the whole micro-batch stays built and held)."""
    from dapo_mcore.data.batching import build_micro_batch
    from dapo_mcore.data.types import Sample
    from dapo_mcore.mcore.compute_selection import EveryMicroBatch, compute_selection

    samples = [
        Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), rollout_logprobs=[-0.5] * n, finish_reason="stop")
        for n in (3000, 2500, 2000, 1500, 1200, 1100)
    ]
    mb = build_micro_batch(samples, list(range(6)), 3008, pad_id=0)
    selection = compute_selection(1, multiple=8)
    cut = selection.cut(mb)
    assert cut.tokens.shape == cut.loss_mask.shape == cut.old_logprobs.shape == (4, 1024)
    assert cut.sample_index == [0, 1, 2, 3] and [seg[1] for seg in cut.segments] == [0, 1, 2, 3]
    assert cut.tokens.data_ptr() == mb.tokens.data_ptr()  # a view: nothing copied
    assert mb.tokens.shape == (6, 3008)
    # the positions left uncomputed take the engine's log-probs; the computed ones are the model's
    full = selection.logprobs(torch.full((4, 1024), -2.0), mb)
    assert full.shape == mb.rollout_logprobs.shape and (full[:4, :1024] == -2.0).all()
    assert torch.equal(full[4:], mb.rollout_logprobs[4:]) and torch.equal(full[:, 1024:], mb.rollout_logprobs[:, 1024:])
    short = build_micro_batch(samples[4:], [0, 1], 1208, pad_id=0)
    assert selection.computed(0, [mb, short]) == [1] and selection.computed(1, [mb, short]) == []  # shortest, first
    training = compute_selection(0, multiple=8)
    assert type(training) is EveryMicroBatch and training.computed(3, [mb, short]) == [0, 1] and training.cut(mb) is mb


def test_a_small_per_rank_load_keeps_mini_batches_the_trainer_takes():
    """The MoE recipe at an 8k mean: about 1 prompt a rank, 2 answers an update at N=2, under the micro-batch
    size of 4 the trainer requires (the rehearsal stopped on it)."""
    cfg = load_config(REPO / "examples/dapo_qwen3_30b_a3b_h100.yaml")
    shape = RecipeShape.of(cfg, gpus=8)
    counts = per_rank_counts(shape, 2, load=0.02)
    assert counts.mini_batch_size >= cfg.trainer.micro_batch_size
    assert counts.mini_batch_size <= counts.prompts_per_step * shape.answers_per_prompt


def test_a_moe_recipe_is_rehearsed_at_the_largest_expert_parallel_its_processes_allow(tmp_path):
    """The 30B-A3B recipe's EP 8: EP 2 on 2 processes, 4 on 4, 8 on 8 (it was always 1, so the expert
    all-to-alls and the equal micro-batch counts an EP group needs were never rehearsed)."""
    cfg = load_config(str(REPO / "examples/dapo_qwen3_30b_a3b_h100.yaml"), [])
    shape = RecipeShape.of(cfg, 8)
    assert [shape.expert_parallel_at(n) for n in (2, 4, 8, 6)] == [2, 4, 8, 2]
    overrides = rehearsal_overrides(full_counts(shape, 2), tmp_path, tmp_path / "run", 2048, 1, 1, True, 2)
    assert "parallel.expert_model_parallel_size=2" in overrides


def test_a_recipe_is_rehearsed_at_the_largest_engine_tp_its_processes_allow_with_partial_rollout(tmp_path):
    """Engine TP stayed 1 in every rehearsal, and partial rollout at engine TP > 1 was refused with the synthetic
    engine: an engine replica's ranks agreeing on verdicts and stopping together was never rehearsed."""
    recipe = str(REPO / "examples/dapo_qwen2.5_7b_h100.yaml")
    assert RecipeShape.of(load_config(recipe, []), 8).engine_tp_at(2) == 1  # the recipe's engine TP 1
    asked = ["rollout.engine_tp_size=2", "rollout.partial_rollout=true", "rollout.partial_oversample=2"]
    shape = RecipeShape.of(load_config(recipe, asked), 8)
    assert [shape.engine_tp_at(n) for n in (2, 4, 3)] == [2, 2, 1]
    counts = per_rank_counts(shape, 4, load=0.1)
    model = shrink_model(json.loads((REPO / "examples/models/Qwen2.5-7B/config.json").read_text()), tmp_path / "m")
    overrides = rehearsal_overrides(counts, model, tmp_path / "run", 2048, 1, 1, True, 1, shape.engine_tp_at(4))
    assert "rollout.engine_tp_size=2" in overrides
    cfg = load_config(recipe, [*asked, *overrides])
    assert cfg.rollout.engine == "synthetic" and cfg.rollout.partial_rollout
    validate(cfg)  # refused before: only the vllm adapter stopped an engine's TP ranks together
    with pytest.raises(ConfigError, match="only the vllm adapter .* stops an engine's TP ranks at one step"):
        validate(load_config(recipe, [*asked, *overrides, "rollout.engine=hf", "algorithm.reward.verifier=dapo"]))


def test_a_second_rehearsal_into_the_same_output_moves_the_first_runs_aside(tmp_path, monkeypatch, capsys):
    """The first run's N2/ was moved aside by train (an earlier run in its run directory) under the rehearsal's
    own open log, and the second rehearsal failed with FileNotFoundError on N2/train.log."""
    import argparse

    from dapo_mcore.rehearse import command

    def launch_as_train(recipe, overrides, records, world, log):
        with open(log, "w") as out:  # as launch: the log is open before train starts
            run_dir = log.parent
            if (run_dir / "metrics.jsonl").exists():  # train moves an earlier run aside (resume=none)
                run_dir.rename(run_dir.with_name(run_dir.name + ".prev-train"))
                run_dir.mkdir()
            out.write("trained\n")
            (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        return 1.0

    monkeypatch.setattr(command, "launch", launch_as_train)
    args = argparse.Namespace(recipe="r.yaml", no_save=True)
    for _ in range(2):
        command.run_world(args, [], 2, tmp_path / "N2")
    assert (tmp_path / "N2" / "train.log").read_text() == "trained\n"
    (aside,) = tmp_path.glob("N2.prev-*")
    assert (aside / "train.log").is_file() and "moved the earlier rehearsal's" in capsys.readouterr().out


def test_a_rehearsal_stops_in_one_line_on_a_non_finite_loss_or_gradient_norm(tmp_path):
    """Where the rehearsal reads each step's metrics (report.World.read): metrics.jsonl writes NaN and inf as null;
    a step with an update and such a loss or gradient norm stops the rehearsal there, naming the step; a step
    without an update (no gradient norm: null by design) does not."""
    from dapo_mcore.rehearse.report import RehearsalFailed, World
    from dapo_mcore.rehearse.setup import Counts

    (tmp_path / "records").mkdir()
    rows = [
        {"step": 1, "actor/updates": 1.0, "loss/policy": 0.12, "actor/grad_norm": 0.7},
        {"step": 2, "actor/updates": 0.0, "loss/policy": 0.0, "actor/grad_norm": None},  # every group filtered
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    counts = Counts(2, 4, 8, 16)
    assert [m["step"] for m in World.read(2, counts, tmp_path / "records", tmp_path, 1.0).metrics] == [1, 2]
    for bad in ({"actor/grad_norm": None}, {"loss/policy": None}):
        row = {"step": 3, "actor/updates": 2.0, "loss/policy": 0.1, "actor/grad_norm": 0.5, **bad}
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, row]))
        with pytest.raises(RehearsalFailed) as stopped:
            World.read(2, counts, tmp_path / "records", tmp_path, 1.0)
        (line,) = str(stopped.value).splitlines()
        (key,) = bad
        assert f"non-finite {key} at step 3" in line and "NaN or inf" in line and str(tmp_path) in line
        assert "on 2 processes" in line
