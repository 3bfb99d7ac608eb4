"""The errors dapo_mcore raises for bad input. The CLI prints them as one clear line, no traceback."""


class DapoError(Exception):
    """Base of every user-facing error: the message alone must say what is wrong and how to fix it."""


class ConfigError(DapoError):
    """A config file, key, value or override is wrong."""


class DataError(DapoError):
    """A data file is missing or a row of it is malformed."""


class LayoutError(DapoError):
    """A parallel layout does not fit the world size or the model."""


class CheckpointError(DapoError):
    """A checkpoint is missing, incomplete or does not match the model."""
