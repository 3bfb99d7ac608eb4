"""The errors dapo_mcore raises for bad input and for failed engines. The CLI prints them as one clear line, no
traceback, and exits with the error's `exit_code`: 2 for bad input (a user's verifier or filter that raised
included), ENGINE_EXIT_CODE for an engine failure."""

# Bad input (config, data, layout, checkpoint, preflight): fix the input, then run again.
BAD_INPUT_EXIT_CODE = 2
# A rollout engine raised or died (an OOM, a CUDA or NCCL error, a worker lost): the input may be fine, and a
# scheduler or a person can tell this apart from 2 (and from 75: saved, run again; 130/143: stopped).
ENGINE_EXIT_CODE = 3


class DapoError(Exception):
    """Base of every user-facing error: the message alone must say what is wrong and how to fix it."""

    # Raised alike on every rank (a bad config is bad everywhere), so rank 0 alone prints it.
    same_on_every_rank = True
    exit_code = BAD_INPUT_EXIT_CODE


class ConfigError(DapoError):
    """A config file, key, value or override is wrong."""


class DataError(DapoError):
    """A data file is missing or a row of it is malformed."""


class LayoutError(DapoError):
    """A parallel layout does not fit the world size or the model."""


class CheckpointError(DapoError):
    """A checkpoint is missing, incomplete or does not match the model."""


class PreflightError(DapoError):
    """A check before training failed; the message has one line per problem."""

    same_on_every_rank = False  # a missing mount or GPU may be one node's alone


class EngineError(DapoError):
    """A rollout engine raised or its worker died; raised on the rank whose engine failed, chained to the
    original exception (`__cause__`), whose traceback rollout/guard.py has logged."""

    same_on_every_rank = False
    exit_code = ENGINE_EXIT_CODE


class UserCodeError(DapoError):
    """A function the config names (algorithm.reward.verifier, algorithm.dynamic_sampling.filter) raised: the
    message names the key, the function and the exception. Bad input (exit 2): the function needs fixing, not the
    engine, even when it raised inside the engine's step loop (partial rollout judges groups there). Raised on the
    rank whose replica judged the group, chained to the exception, whose traceback is logged there."""

    same_on_every_rank = False


class MismatchError(DapoError):
    """The engine's log-probs of its own samples are far from the actor's: it generated with other weights (a
    broken weight push). The gap is a step metric, the same on every rank."""

    exit_code = ENGINE_EXIT_CODE


class NonFiniteGradients(DapoError):
    """A backward gave a NaN or infinite gradient: the update is not made (Adam would write NaN weights, and the
    push would hand them to the engine). Every rank agrees on it before any rank steps. Exit 2: a run that would
    diverge again from its last save needs a person (a learning rate, a loss setting, a bad sample), not a
    requeue."""


class RunLockError(DapoError):
    """Another live run holds the run directory, or its lock file cannot be made (a read-only or full file
    system, no permission, a quota): the message names the path."""


class RunFilesError(DapoError):
    """A file of the run directory (config.yaml, metrics.jsonl) cannot be written: the message names the path and
    the system's reason. Raised by rank 0, which alone writes them."""

    same_on_every_rank = False


def os_reason(err: OSError) -> str:
    """What the system said, without Python's "[Errno N]" and the path: "Read-only file system"."""
    return err.strerror or str(err)
