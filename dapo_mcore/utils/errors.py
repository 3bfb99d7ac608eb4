"""The errors dapo_mcore raises for bad input. The CLI prints them as one clear line, no traceback."""


class DapoError(Exception):
    """Base of every user-facing error: the message alone must say what is wrong and how to fix it."""

    # Raised alike on every rank (a bad config is bad everywhere), so rank 0 alone prints it.
    same_on_every_rank = True


class ConfigError(DapoError):
    """A config file, key, value or override is wrong."""


class DataError(DapoError):
    """A data file is missing or a row of it is malformed."""


class LayoutError(DapoError):
    """A parallel layout does not fit the world size or the model."""


class CheckpointError(DapoError):
    """A checkpoint is missing, incomplete or does not match the model."""


class EngineError(DapoError):
    """A rollout engine raised or its worker died; raised on the rank whose engine failed."""

    same_on_every_rank = False


class RunLockError(DapoError):
    """Another live run holds the run directory."""
