"""How a problem becomes the prompt tokens the engine sees: the model's own chat template (chat / instruct
models) or plain text (base models), optionally wrapped in the DAPO paper's instruction.

The engine's tokens are trained as they are (never re-tokenised from decoded text); only the prompt is made
here. A PromptFormatter is called like a tokenizer: `formatter(problem).input_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dapo_mcore.utils.errors import ConfigError, DataError

# The DAPO paper's instruction around each problem (its training data carries it; arXiv 2503.14476, sec. 4).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
INSTRUCTIONS = {"none": ("", ""), "dapo": (DAPO_PREFIX, DAPO_SUFFIX)}


def instruction_parts(instruction: str) -> tuple[str, str]:
    """The text before and after the problem: a named instruction, or your own with {problem} in it."""
    if instruction in INSTRUCTIONS:
        return INSTRUCTIONS[instruction]
    if "{problem}" not in instruction:
        raise ConfigError(
            f"data.instruction must be one of {sorted(INSTRUCTIONS)} or a text with {{problem}} in it, "
            f"got {instruction!r}"
        )
    prefix, _, suffix = instruction.partition("{problem}")
    return prefix, suffix


def wrap(problem: str, prefix: str, suffix: str) -> str:
    """prefix + problem + suffix, unless the problem carries that instruction already: prompt files prepared
    with it (tools/prepare_data.py --instruction dapo, the DAPO-Math-17k prompts) read the same whether or not
    the run or the eval adds it too (it was applied twice to AIME files prepared with it)."""
    if (prefix or suffix) and problem.startswith(prefix) and problem.endswith(suffix):
        return problem
    return prefix + problem + suffix


@dataclass
class _Encoded:
    input_ids: list[int]


class PromptFormatter:
    def __init__(
        self,
        tokenizer: Any,
        template: str = "none",
        instruction: str = "none",
        system_prompt: str = "",
        keep_last: int = 0,
    ):
        if template not in ("none", "chat"):
            raise ConfigError(f"data.template must be 'none' or 'chat', got {template!r}")
        self.prefix, self.suffix = instruction_parts(instruction)
        if template == "chat" and not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "the model")
            raise ConfigError(
                f"data.template=chat: {name} has no chat template (a base model?); use data.template=none"
            )
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt
        self.keep_last = keep_last  # > 0: a longer prompt keeps its last keep_last tokens (left truncation)

    def text(self, problem: str) -> str:
        """The prompt as text (for logs and eval reports)."""
        body = wrap(problem, self.prefix, self.suffix)
        if self.template == "none":
            return body
        return self.tokenizer.apply_chat_template(self._messages(body), add_generation_prompt=True, tokenize=False)

    def __call__(self, problem: str) -> _Encoded:
        body = wrap(problem, self.prefix, self.suffix)
        if self.template == "none":
            ids = list(self.tokenizer(body).input_ids)
        else:
            ids = self.tokenizer.apply_chat_template(self._messages(body), add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding by default
                ids = ids["input_ids"]
        return _Encoded(list(ids)[-self.keep_last :] if self.keep_last else list(ids))

    def _messages(self, body: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": body}]


def apply_length_policy(
    prompts: list[Any], encode: PromptFormatter, limit: int, policy: str, where: str
) -> tuple[list[Any], int]:
    """Prompts longer than `limit` tokens: an error naming the first (file:row, its length), dropped, or kept
    for left truncation (policy "truncate_left": the formatter cuts them). Returns the prompts kept and how many
    were over the limit."""
    too_long = [(p, n) for p in prompts if (n := len(encode(p.text).input_ids)) > limit]
    if not too_long:
        return prompts, 0
    if policy == "error":
        first, length = too_long[0]
        raise DataError(
            f"{first.uid}: the prompt is {length} tokens, longer than the {limit} allowed ({where}); "
            f"{len(too_long)} prompts of this file are; set data.long_prompts=drop or truncate_left, or "
            "data.max_prompt_len"
        )
    if policy == "drop":
        long_ids = {id(p) for p, _ in too_long}
        return [p for p in prompts if id(p) not in long_ids], len(too_long)
    return prompts, len(too_long)
