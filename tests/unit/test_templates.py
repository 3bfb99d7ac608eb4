"""Prompt formatting (plain, the DAPO instruction, a model's chat template) and the stop ids engines use."""

import json

import pytest

from dapo_mcore.data.templates import DAPO_PREFIX, DAPO_SUFFIX, PromptFormatter
from dapo_mcore.data.tokenizer import build_char_tokenizer
from dapo_mcore.rollout.model_info import stop_token_ids
from dapo_mcore.utils.errors import ConfigError

CHAT = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture()
def tokenizer(tmp_path):
    from transformers import AutoTokenizer

    build_char_tokenizer(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def decode(tokenizer, ids):
    return tokenizer.decode(ids)


def test_plain_prompts_are_the_problem_as_is(tokenizer):
    fmt = PromptFormatter(tokenizer)
    assert fmt("What is 2+3?").input_ids == tokenizer("What is 2+3?").input_ids


def test_the_dapo_instruction_wraps_the_problem(tokenizer):
    fmt = PromptFormatter(tokenizer, instruction="dapo")
    assert fmt.text("What is 2+3?") == DAPO_PREFIX + "What is 2+3?" + DAPO_SUFFIX
    assert decode(tokenizer, fmt("What is 2+3?").input_ids) == fmt.text("What is 2+3?")


def test_an_instruction_of_your_own_puts_the_problem_at_its_placeholder(tokenizer):
    fmt = PromptFormatter(tokenizer, instruction="Q: {problem}\nEnd with Answer: N")
    assert fmt.text("What is 2+3?") == "Q: What is 2+3?\nEnd with Answer: N"
    with pytest.raises(ConfigError, match="or a text with {problem} in it"):
        PromptFormatter(tokenizer, instruction="daPo")


def test_the_chat_template_is_applied_with_the_generation_prompt(tokenizer):
    tokenizer.chat_template = CHAT
    fmt = PromptFormatter(tokenizer, template="chat", system_prompt="Be brief.")
    want = "<system>Be brief.\n<user>What is 2+3?\n<assistant>"
    assert fmt.text("What is 2+3?") == want
    assert fmt("What is 2+3?").input_ids == tokenizer(want).input_ids


def test_chat_without_a_chat_template_is_a_config_error(tokenizer):
    with pytest.raises(ConfigError, match="has no chat template"):
        PromptFormatter(tokenizer, template="chat")


def test_stop_ids_are_every_eos_the_model_declares(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert stop_token_ids(str(tmp_path), tokenizer_eos_id=5) == [5, 2, 7, 9]
    assert stop_token_ids(str(tmp_path / "missing"), tokenizer_eos_id=5) == [5]
