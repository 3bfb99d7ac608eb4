"""What a new user finds from the command line alone: keys with their descriptions, examples in --help,
--version, and the eval flags' defaults."""

import argparse
from importlib.metadata import version

import pytest

from dapo_mcore.cli import _parser, main
from dapo_mcore.config import all_keys
from dapo_mcore.config.key_docs import key_descriptions


def test_keys_prints_each_default_with_the_comment_above_its_schema_field(capsys):
    assert main(["keys", "algorithm.overlong"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == [
        "algorithm.overlong.enabled = True",
        "    Soft overlong punishment (paper eq. 13): linear penalty in the last buffer_len tokens before L_max.",
        "algorithm.overlong.buffer_len = 4096",
        "    L_cache in the paper (4096 with L_max = 20480).",
    ]
    at = lines.index("algorithm.overlong.penalty_factor = 1.0")
    assert lines[at + 1] == "    Scale of that penalty: -penalty_factor at L_max (paper: 1.0)."
    assert all(line.startswith(("algorithm.overlong.", "    ")) for line in lines)


def test_keys_prefix_may_end_inside_a_key_name(capsys):
    assert main(["keys", "trainer.eval"]) == 0
    printed = [line.split(" = ")[0] for line in capsys.readouterr().out.splitlines() if " = " in line]
    assert printed == [
        "trainer.eval_interval",
        "trainer.eval_k",
        "trainer.eval_temperature",
        "trainer.eval_top_p",
        "trainer.eval_max_response_len",
        "trainer.eval_also_verifiers",
    ]


def test_keys_with_an_unknown_prefix_is_one_line_naming_the_closest(capsys):
    assert main(["keys", "algoritm.overlong"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dapo-mcore: error: keys: no config key starts with 'algoritm.overlong'; did you mean ")
    assert "algorithm.overlong" in err and err.count("\n") == 1


def test_key_descriptions_join_a_multi_line_comment_and_name_only_real_keys():
    descriptions = key_descriptions()
    assert descriptions["model.init"] == (
        '"hf": load the weights of hf_path; "mcore": load them from the Megatron-Core checkpoint at mcore_path '
        '(tools/convert_hf_to_mcore.py output, or a run save); "random": Megatron\'s initialisation.'
    )
    assert set(descriptions) == set(all_keys())  # a key added without a comment above it fails here


def test_version_prints_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"dapo-mcore {version('dapo-mcore')}"


def test_help_ends_with_an_example_of_each_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("train", "plan", "check", "eval", "keys", "plot"):
        assert f"\n  dapo-mcore {command} " in out.split("examples:")[1], command
    assert "SUPPRESS" not in out and "rehearse-rank" not in out  # the launcher's own subcommand is not listed


@pytest.mark.parametrize("command", [[], ["eval"]])
def test_every_eval_example_asks_for_top_p_1(command, capsys):
    """The default top-p 0.7 (the paper's AIME setting) printed zeros on the demo model: the README's example says
    --top-p 1.0, and --help's examples now do too."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    examples = capsys.readouterr().out.split("examples:")[1].replace("\\\n", "")
    evals = [line for line in examples.splitlines() if line.strip().startswith("dapo-mcore eval")]
    assert evals and all("--top-p 1.0" in line for line in evals), evals


@pytest.mark.parametrize("command", ["train", "plan", "eval", "keys", "plot"])
def test_subcommand_help_has_examples_of_itself(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert f"\n  dapo-mcore {command} " in capsys.readouterr().out.split("examples:")[1]


def test_every_eval_flag_says_its_default():
    eval_parser = _subcommand("eval")
    for action in eval_parser._actions:
        if action.option_strings and not action.required and not isinstance(action, argparse._HelpAction):
            assert action.help and "default" in action.help, action.option_strings
    text = eval_parser.format_help()
    assert "(default 0.7:" in " ".join(text.split())  # --top-p, from the schema's trainer.eval_top_p


def _subcommand(name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]
