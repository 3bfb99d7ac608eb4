import re
from pathlib import Path

import pytest

from dapo_mcore.config import RunConfig, all_keys, dump_config, load_config, parse_override, validate
from dapo_mcore.config.validate import eval_file_list, run_dir_of
from dapo_mcore.utils.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_are_the_papers_settings():
    cfg = RunConfig()
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (0.2, 0.28)
    assert cfg.rollout.sampling.max_response_len == 20480 and cfg.algorithm.overlong.buffer_len == 4096
    assert cfg.optimizer.lr == 1e-6 and cfg.optimizer.weight_decay == 0.1 and cfg.optimizer.clip_grad == 1.0
    assert cfg.rollout.n_samples_per_prompt == 16 and cfg.rollout.prompts_per_step == 512


def test_unknown_key_names_the_key_the_file_and_the_closest_valid_key(tmp_path):
    recipe = write(tmp_path / "r.yaml", "algorithm:\n  clip_hgh: 0.3\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'algorithm.clip_hgh' in .*r.yaml; "
        r"did you mean 'algorithm.clip_high'",
    ):
        load_config(recipe)


def test_known_leaf_under_the_wrong_section_suggests_the_right_section():
    with pytest.raises(ConfigError, match="did you mean 'algorithm.clip_high'"):
        load_config(None, ["rollout.clip_high=0.3"])


def test_unknown_top_level_section_is_an_error():
    with pytest.raises(ConfigError, match="unknown config key 'algorthm'.*did you mean 'algorithm'"):
        load_config(None, ["algorthm.clip_high=0.3"])


def test_wrong_types_are_errors_naming_the_key():
    with pytest.raises(ConfigError, match="'trainer.steps' must be an integer, got 'many'"):
        load_config(None, ["trainer.steps=many"])
    with pytest.raises(ConfigError, match="'parallel.device' must be one of"):
        load_config(None, ["parallel.device=tpu"])
    with pytest.raises(ConfigError, match="'algorithm.overlong.enabled' must be true or false"):
        load_config(None, ["algorithm.overlong.enabled=3"])
    with pytest.raises(ConfigError, match="'algorithm' .* is a section"):
        load_config(None, ["algorithm=3"])


def test_yaml_1_1_exponent_strings_are_read_as_floats(tmp_path):
    recipe = write(tmp_path / "r.yaml", "optimizer:\n  lr: 1e-6\n")
    assert load_config(recipe).optimizer.lr == 1e-6


@pytest.mark.parametrize("value", ["on", "off", "auto"])
def test_on_and_off_stay_words_where_the_schema_wants_a_word(tmp_path, value):
    """YAML 1.1 reads on / off as booleans: `trainer.packing=off` was refused as "must be a string"."""
    assert load_config(None, [f"trainer.packing={value}"]).trainer.packing == value
    recipe = write(tmp_path / "r.yaml", f"trainer:\n  packing: {value}\n")
    assert load_config(recipe).trainer.packing == value


def test_yes_no_on_off_still_mean_booleans_where_the_schema_wants_one():
    cfg = load_config(None, ["checkpoint.async_save=yes", "logging.progress=off"])
    assert (cfg.checkpoint.async_save, cfg.logging.progress) == (True, False)


def test_defaults_inheritance_then_overrides_take_precedence(tmp_path):
    write(tmp_path / "base.yaml", "name: base\ntrainer:\n  steps: 7\n  micro_batch_size: 2\n")
    child = write(tmp_path / "child.yaml", "defaults: [base.yaml]\nname: child\ntrainer:\n  steps: 9\n")
    cfg = load_config(child, ["trainer.micro_batch_size=3"])
    assert (cfg.name, cfg.trainer.steps, cfg.trainer.micro_batch_size) == ("child", 9, 3)


def test_a_derived_recipe_without_a_name_is_named_for_its_file_never_for_its_parent(tmp_path):
    """my_7b.yaml deriving from a recipe named dapo_qwen2.5_7b used to write into (and, with resume=auto,
    continue) runs/dapo_qwen2.5_7b."""
    write(tmp_path / "parent.yaml", "name: parent_run\ntrainer:\n  steps: 7\n")
    child = write(tmp_path / "my_7b.yaml", "defaults: parent.yaml\noptimizer:\n  lr: 2.0e-6\n")
    grandchild = write(tmp_path / "my_7b_long.yaml", "defaults: my_7b.yaml\ntrainer:\n  steps: 9\n")
    assert load_config(child).name == "my_7b"
    assert load_config(grandchild).name == "my_7b_long"
    assert load_config(tmp_path / "parent.yaml").name == "parent_run"  # a name written in the file is kept
    assert load_config(child, ["name=other"]).name == "other"
    assert run_dir_of(load_config(child)) == Path("runs/my_7b")


def test_defaults_cycle_and_missing_parent_are_errors(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    orphan = write(tmp_path / "c.yaml", "defaults: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="config file not found: .*nowhere.yaml .*named in defaults of"):
        load_config(orphan)


def test_missing_config_file_and_bad_override_syntax_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not of the form section.key=value"):
        parse_override("trainer.steps")


def test_resolved_config_round_trips_through_its_dump(tmp_path):
    cfg = load_config(REPO / "examples/smoke_cpu.yaml", ["algorithm.clip_high=0.3"])
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_every_schema_key_is_listed():
    keys = all_keys()
    assert "algorithm.overlong.buffer_len" in keys and "rollout.sampling.top_p" in keys
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.clip_low=1.5", "clip_low must be in"),
        ("algorithm.overlong.buffer_len=40000", "buffer_len=40000 must be in"),
        ("rollout.n_samples_per_prompt=1", "every group would be dropped"),
        ("trainer.micro_batch_size=1000", "smaller than trainer.micro_batch_size"),
        ("data.source=missing.jsonl", "file not found"),
        ("data.ops=/", "data.ops must be made of"),
        ("model.hf_path=/nonexistent", "no config.json"),
        # NaN passed every `x >= 0` bound: under Slurm a NaN margin stopped the run after every step
        ("checkpoint.time_limit_margin_s=nan", "checkpoint.time_limit_margin_s=nan: a setting must be a number"),
        ("checkpoint.time_limit_margin_s=-5", "time_limit_margin_s must be a number of seconds >= 0, got -5"),
        ("algorithm.clip_high=nan", "algorithm.clip_high=nan: a setting must be a number"),
    ],
)
def test_semantic_checks_name_the_offending_keys(override, message, tiny_llama_dir):
    cfg = load_config(REPO / "examples/smoke_cpu.yaml", [f"model.hf_path={tiny_llama_dir}", override])
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_shipped_recipes_load_and_validate():
    for recipe in sorted((REPO / "examples").glob("*.yaml")):
        cfg = load_config(recipe)
        if cfg.model.hf_path and Path(cfg.model.hf_path).exists():  # a base recipe (dapo_paper.yaml) names no model
            validate(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.eval_interval=5"], "trainer.eval_interval > 0 needs data.eval_files"),
        (["trainer.eval_interval=5", "data.eval_files=nope.jsonl"], "data.eval_files: file not found: nope.jsonl"),
        (["data.eval_files=examples/smoke_cpu.yaml"], "is not a .jsonl file"),
        (["trainer.eval_top_p=0"], "trainer.eval_top_p must be in (0, 1]"),
        (["trainer.eval_k=0"], "trainer.eval_k must be >= 1"),
        (["trainer.eval_also_verifiers=gsm8k,math_verify"], "'math_verify' is not one of ('dapo', 'gsm8k')"),
        (
            ["algorithm.policy_loss=gpso"],
            "'algorithm.policy_loss' must be one of ['dapo', 'gspo', 'cispo', 'sapo'], "
            "got 'gpso'; did you mean 'gspo'?",
        ),
        (
            ["algorithm.mismatch.tis=token_mask"],
            "'algorithm.mismatch.tis': token_mask was renamed token_reject (it drops out-of-band tokens from the "
            "denominator, verl's token rejection); IcePop as published is tis=icepop",
        ),
        (["algorithm.sapo.tau_neg=0"], "algorithm.sapo: tau_pos / tau_neg must be > 0"),
        (
            ["algorithm.mismatch.token_mask_low=2", "algorithm.mismatch.token_mask_high=1"],
            "token_mask_low < token_mask_high",
        ),
        (["rollout.partial_rollout=true", "rollout.partial_oversample=0.5"], "rollout.partial_oversample must be >= 1"),
        (["rollout.partial_rollout=true", "rollout.partial_max_staleness=-1"], "partial_max_staleness must be >= 0"),
        (["rollout.partial_rollout=true", "algorithm.dynamic_sampling.mode=dynamic_batch"], "needs algorithm.dynamic"),
    ],
)
def test_validation_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(REPO / "examples/smoke_cpu.yaml", overrides))


def test_eval_files_are_a_comma_separated_list():
    assert eval_file_list(" a.jsonl, b.jsonl ,") == ["a.jsonl", "b.jsonl"]


def test_a_key_added_since_an_older_save_at_its_default_does_not_make_another_experiment():
    """A job re-queued after an upgrade that added rollout.partial_max_staleness was refused by resume=auto."""
    from dapo_mcore.config.loader import changes_the_experiment, config_changes, config_to_dict

    now = config_to_dict(RunConfig())
    saved = config_to_dict(RunConfig())
    del saved["rollout"]["partial_max_staleness"]
    saved["algorithm"]["no_longer_a_key"] = 1
    changes = config_changes(saved, now)
    assert len(changes) == 2 and not any(map(changes_the_experiment, changes))
    now["rollout"]["partial_max_staleness"] = 3  # set otherwise than its default: the experiment differs
    assert [c[0] for c in config_changes(saved, now) if changes_the_experiment(c)] == ["rollout.partial_max_staleness"]
    assert changes_the_experiment(("algorithm.clip_high", 0.28, 0.3))
    assert not changes_the_experiment(("trainer.steps", 10, 20))


@pytest.mark.parametrize("rank, lines", [("0", 1), ("1", 0)])
def test_the_resume_warning_on_changed_keys_is_rank_0s_alone(monkeypatch, rank, lines):
    """Every rank logs warnings (utils/logging.py): the list of changed keys was printed once a rank under torchrun.
    What every continuation changes (trainer.steps, logging.run_dir) is not listed."""
    from dapo_mcore import build
    from dapo_mcore.config.loader import config_to_dict

    saved = load_config(REPO / "examples/smoke_cpu.yaml", [])
    overrides = ["checkpoint.resume=force", "algorithm.clip_high=0.3", "trainer.steps=99", "logging.run_dir=/x"]
    now = load_config(REPO / "examples/smoke_cpu.yaml", overrides)
    warned = []
    monkeypatch.setattr(build.log, "warning", lambda fmt, *args: warned.append(fmt % args))
    monkeypatch.setenv("RANK", rank)
    build.check_config_changes(now, build.Resume(Path("step_000002"), {"config": config_to_dict(saved)}))
    assert len(warned) == lines
    if warned:
        assert warned[0] == "resuming from step_000002 with 1 config keys changed since the save: " + (
            "algorithm.clip_high: 0.28 -> 0.3"
        )


def test_sapo_and_gspo_take_their_papers_sequence_mean_unless_told_otherwise_and_say_so():
    """SAPO (arXiv 2511.20347) and GSPO (arXiv 2507.18071), as verl, average each sequence's tokens, then the
    sequences; loss_agg=auto gives
    each policy loss its paper's aggregation, and an explicit other one is run with one warning line."""
    from dapo_mcore.build import loss_settings
    from dapo_mcore.config.validate import config_warnings

    losses = ("dapo", "sapo", "gspo", "cispo")
    agg = {p: loss_settings(load_config(None, [f"algorithm.policy_loss={p}"])).agg_mode for p in losses}
    assert agg == {"dapo": "token-mean", "sapo": "seq-mean-token-mean", "gspo": "seq-mean-token-mean",
                   "cispo": "token-mean"}  # fmt: skip
    assert config_warnings(load_config(None, ["algorithm.policy_loss=gspo", "algorithm.loss_agg=token-mean"]))
    assert config_warnings(load_config(None, ["algorithm.policy_loss=sapo"])) == []
    told = load_config(None, ["algorithm.policy_loss=sapo", "algorithm.loss_agg=token-mean"])
    assert loss_settings(told).agg_mode == "token-mean"
    (line,) = config_warnings(told)
    assert "algorithm.loss_agg=token-mean" in line and "seq-mean-token-mean" in line


@pytest.mark.parametrize(("tis", "max_len", "warned"), [("sequence", 8192, True), ("sequence", 4096, False),
                                                        ("sequence_geometric", 8192, False)])  # fmt: skip
def test_sequence_tis_over_long_responses_points_to_the_geometric_mean(tis, max_len, warned):
    from dapo_mcore.config.validate import config_warnings

    cfg = load_config(None, [f"algorithm.mismatch.tis={tis}", f"rollout.sampling.max_response_len={max_len}"])
    lines = config_warnings(cfg)
    assert bool(lines) == warned
    assert all("tis=sequence_geometric" in line for line in lines)


def test_check_says_the_loss_warnings_train_logs(tmp_path, capsys):
    """`dapo-mcore check` lists what train warns about at start: SAPO at another aggregation than its paper's,
    and sequence TIS over long answers (its product of weights is mostly 0 or the cap)."""
    from dapo_mcore.cli import main

    args = ["check", "examples/smoke_cpu.yaml", f"logging.run_dir={tmp_path / 'run'}", "algorithm.policy_loss=sapo",
            "algorithm.loss_agg=token-mean", "algorithm.mismatch.tis=sequence",
            "rollout.sampling.max_response_len=8192"]  # fmt: skip
    main(args)
    said = capsys.readouterr()
    text = said.out + said.err
    assert "warning: algorithm.policy_loss=sapo with algorithm.loss_agg=token-mean" in text
    assert "warning: algorithm.mismatch.tis=sequence with rollout.sampling.max_response_len=8192" in text
    assert "tis=sequence_geometric" in text


def test_reward_routing_is_a_mapping_whose_changes_on_resume_are_changes():
    from dapo_mcore.config.loader import changes_the_experiment, config_changes, config_to_dict

    routed = load_config(None, ["algorithm.reward.verifiers.gsm8k=gsm8k", "algorithm.reward.verifiers.math=dapo"])
    assert routed.algorithm.reward.verifiers == {"gsm8k": "gsm8k", "math": "dapo"}
    whole = load_config(None, ["algorithm.reward.verifiers.gsm8k=gsm8k", "algorithm.reward.verifiers=a=dapo,b=gsm8k"])
    assert whole.algorithm.reward.verifiers == {"a": "dapo", "b": "gsm8k"}  # the a=x,b=y form is the whole mapping
    plain = config_to_dict(load_config(None))
    for old, new in ((config_to_dict(routed), plain), (plain, config_to_dict(routed))):  # a source dropped, added
        changes = config_changes(old, new)
        assert changes and all(changes_the_experiment(change) for change in changes), changes
    demo = "examples/smoke_cpu.yaml"
    with pytest.raises(ConfigError, match="correct_threshold"):
        validate(load_config(demo, ["algorithm.reward.correct_threshold=2"]))
    validate(load_config(demo, ["algorithm.reward.correct_threshold=2", "algorithm.reward.graded=true"]))
