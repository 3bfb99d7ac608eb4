"""A verifiable task that needs no download: arithmetic problems with exact integer answers.

Problem i is a pure function of i (a fixed grid of operands), so any position can be replayed on resume.
"""

from __future__ import annotations

from dapo_mcore.data.types import Prompt

PROMPT_FORMAT = "What is {a}{op}{b}?\n"
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTask:
    """An endless, indexable source of 'What is a+b?' prompts with their answers."""

    def __init__(self, min_operand: int, max_operand: int, ops: str = "+"):
        self.min_operand, self.max_operand, self.ops = min_operand, max_operand, ops

    def __len__(self) -> int:
        span = self.max_operand - self.min_operand + 1
        return span * span * len(self.ops)

    def __getitem__(self, index: int) -> Prompt:
        a, op, b = self.operands(index)
        return Prompt(text=PROMPT_FORMAT.format(a=a, op=op, b=b), answer=str(_OPS[op](a, b)), uid=f"arith-{index}")

    def operands(self, index: int) -> tuple[int, str, int]:
        """The index-th problem of the full grid, in a fixed order (shuffling is the stream's job)."""
        span = self.max_operand - self.min_operand + 1
        if not 0 <= index < len(self):
            raise IndexError(index)
        op_index, rest = divmod(index, span * span)
        a, b = divmod(rest, span)
        return a + self.min_operand, self.ops[op_index], b + self.min_operand
