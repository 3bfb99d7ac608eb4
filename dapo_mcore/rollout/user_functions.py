"""The sampler's calls into functions the config names: the verifier (algorithm.reward.verifier, through its pool)
and the dynamic-sampling filter (algorithm.dynamic_sampling.filter).

Such a function may be the user's own code, and under partial rollout the sampler calls it inside the engine's
step loop (each group is judged as its last answer ends), where rollout/guard.py would report any exception as
"rollout engine failed" (exit 3). An exception from one of them becomes a UserCodeError naming the config key,
the function ('module:function') and the exception (exit 2: fix the function); GuardedEngine lets it through as
every DapoError. Its traceback is logged once, at error level, on the rank it happened on: the line of the
user's code that raised is what they need to fix it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from dapo_mcore.data.types import Group
from dapo_mcore.rewards.contract import is_bool
from dapo_mcore.rewards.pool import Check, Verdict
from dapo_mcore.utils.errors import DapoError, UserCodeError
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)

VERIFIER_KEY = "algorithm.reward.verifier"
FILTER_KEY = "algorithm.dynamic_sampling.filter"


def verified(verify: Callable[[list[Check]], list[Verdict]], pairs: list[Check]) -> list[Verdict]:
    """verify(pairs), or a UserCodeError naming the verifier if it raised. (The pool counts a check that raises
    as wrong; what reaches here failed around the checks, or is a verify function of the caller's own.)"""
    try:
        return verify(pairs)
    except DapoError:
        raise  # already says what is wrong (a verifier worker that did not start)
    except Exception as err:
        raise _user_code_error(VERIFIER_KEY, verify, err, f"checking {len(pairs)} answers") from err


class VerdictCheck:
    """What the verifier's checks say beyond their verdicts, across a run: a value that is no verdict stops the run
    at once (a bug, the same on every answer); exceptions are counted per answer (reward/verifier_errors), the
    first one's traceback logged once, and a batch of checks that all raised stops the run (the verifier cannot
    judge anything: accuracy 0.0 at every step is no training)."""

    def __init__(self, verify: Callable[..., Any]):
        self.name = function_name(verify)
        self.logged_error = self.logged_timeout = False
        self.timeouts_in_a_row = 0

    def __call__(self, verdicts: list[Verdict], where: str, answers: list[str] | None = None) -> int:
        """The number of checks that raised; a UserCodeError for an invalid value, all checks raising, or
        TIMEOUTS_IN_A_ROW checks past their timeout one after another. `answers` (the checked texts) name the
        first timeout's length."""
        self._timeouts(verdicts, where, answers)
        invalid = next((v.invalid for v in verdicts if v.invalid), None)
        if invalid is not None:
            raise UserCodeError(f"{VERIFIER_KEY}={self.name} {invalid} ({where})")
        errors = [v.error for v in verdicts if v.error]
        if errors and not self.logged_error:
            self.logged_error = True
            log.error("%s=%s raised on an answer (%s; such checks count as wrong, reward/verifier_errors counts "
                      "them); its first traceback:\n%s", VERIFIER_KEY, self.name, where,
                      errors[0].rstrip())  # fmt: skip
        if errors and len(errors) == len(verdicts):
            last = errors[0].strip().splitlines()[-1]
            raise UserCodeError(f"{VERIFIER_KEY}={self.name} raised on every one of {len(verdicts)} answers ({where}): "
                                f"{last}; its first traceback is logged above")  # fmt: skip
        return len(errors)

    def _timeouts(self, verdicts: list[Verdict], where: str, answers: list[str] | None) -> None:
        for i, verdict in enumerate(verdicts):
            if verdict.unchecked:  # the call's budget ran out (the pool said so): no sign the verifier hangs
                continue
            if not verdict.timed_out:
                self.timeouts_in_a_row = 0
                continue
            self.timeouts_in_a_row += 1
            if not self.logged_timeout:
                self.logged_timeout = True
                length = f" of {len(answers[i]):,} characters" if answers else ""
                log.warning("%s=%s: a check ran past algorithm.reward.timeout_s on an answer%s (%s): it counts as "
                            "wrong, as every timed-out check (reward/timeouts counts them)", VERIFIER_KEY, self.name,
                            length, where)  # fmt: skip
        if self.timeouts_in_a_row >= TIMEOUTS_IN_A_ROW:
            raise UserCodeError(
                f"{VERIFIER_KEY}={self.name} timed out on {self.timeouts_in_a_row} answers in a row ({where}): it "
                "cannot judge them within algorithm.reward.timeout_s (each counted as wrong); fix the verifier or "
                "raise the timeout"
            )


# Checks past their timeout one after another that stop the run: a verifier that hangs on every answer.
TIMEOUTS_IN_A_ROW = 32


def kept_by(keep_filter: Callable[[Group], bool], group: Group) -> bool:
    """Whether the filter keeps `group`, or a UserCodeError naming the filter if it raised or returned anything but
    a bool (bool() of "no" or NaN is True: every group was kept without a word)."""
    try:
        keep = keep_filter(group)
    except DapoError:
        raise
    except Exception as err:
        raise _user_code_error(FILTER_KEY, keep_filter, err, f"on the group of prompt {group.prompt.uid}") from err
    if is_bool(keep):  # numpy's too
        return bool(keep)
    raise UserCodeError(
        f"{FILTER_KEY}={function_name(keep_filter)} returned {keep!r} ({type(keep).__name__}) on the group of prompt "
        f"{group.prompt.uid}: a dynamic-sampling filter returns a bool (True: keep the group)"
    )


def _user_code_error(key: str, fn: Callable[..., Any], err: Exception, where: str) -> UserCodeError:
    name = function_name(fn)
    log.error("%s=%s raised %s; its traceback:", key, name, where, exc_info=err)
    lines = str(err).strip().splitlines()
    cause = f"{type(err).__name__}: {lines[-1]}" if lines else type(err).__name__
    return UserCodeError(f"{key}={name} raised {cause} ({where}; its traceback is logged above)")


def function_name(fn: Callable[..., Any]) -> str:
    """The function as the config names it: 'module:function', or the verifier spec behind the sampler's verify
    (rewards.pool.VerifierPool.verify, wrapped by rollout.agreement.AgreedVerify: the pool's `spec`)."""
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)) and callable(getattr(fn, "verify", None)):
        return function_name(fn.verify)  # a wrapper around the pool's verify (AgreedVerify)
    spec = getattr(getattr(fn, "__self__", None), "spec", None)
    if isinstance(spec, str):
        return spec
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}:{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"
