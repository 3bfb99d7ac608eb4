"""The CLI with the system refusing a chosen file write, as a read-only mount, a quota or a full disk refuses it:

    python tests/faults/os_error_at.py PATTERN ERRNO NTH -- CLI ARGS

The NTH opening for writing (1: the first) of a file whose name matches PATTERN (fnmatch, the name alone) raises
OSError(ERRNO) naming the file, at the real call: `open` and `io.open` (pathlib's open, write_text, torch.save,
Megatron's shard writers) and `os.open` (the run lock). ERRNO is a name of the errno module: EROFS, EACCES,
EDQUOT, ENOSPC. Root ignores permissions, and a read-only or full mount needs one mounted: this makes each case
on any machine. Used by tests/faults/test_bad_input.py."""

from __future__ import annotations

import builtins
import errno
import fnmatch
import io
import os
import sys

from dapo_mcore import cli

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def refuse(pattern: str, code: int, nth: int) -> None:
    calls = 0

    def matches(path, writing: bool) -> bool:
        nonlocal calls
        if not writing or not isinstance(path, (str, bytes, os.PathLike)):
            return False
        if not fnmatch.fnmatch(os.path.basename(os.fsdecode(path)), pattern):
            return False
        calls += 1
        return calls == nth

    def refused(path) -> OSError:
        return OSError(code, os.strerror(code), os.fsdecode(path))

    def wrap_open(original):
        def open_refusing(file, mode="r", *args, **kwargs):
            if matches(file, any(c in mode for c in "wax+")):
                raise refused(file)
            return original(file, mode, *args, **kwargs)

        return open_refusing

    original_os_open = os.open

    def os_open_refusing(path, flags, *args, **kwargs):
        if matches(path, bool(flags & _WRITE_FLAGS)):
            raise refused(path)
        return original_os_open(path, flags, *args, **kwargs)

    builtins.open = io.open = wrap_open(io.open)
    os.open = os_open_refusing


if __name__ == "__main__":
    pattern, code, nth, separator, *cli_args = sys.argv[1:]
    assert separator == "--", sys.argv
    refuse(pattern, getattr(errno, code), int(nth))
    sys.argv = ["dapo-mcore", *cli_args]
    sys.exit(cli.main())
