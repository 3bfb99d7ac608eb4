"""A stand-in for sgl_kernel in SGLang's CPU *test* environment only (never installed for users).

SGLang imports a few CPU kernels from sgl_kernel when its modules load; the CPU build of sgl-kernel is not
on the package index (its source targets Xeons with AMX). Every name this module gives out raises when
called, so a test that reaches a real kernel fails loudly instead of computing something else. The engine
contract tests run with the torch-native attention backend and never call one.
"""


class StandInKernelCalled(RuntimeError):
    pass


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def stand_in(*args, **kwargs):
        raise StandInKernelCalled(f"sgl_kernel.{name} was called, but this CPU test environment has no sgl_kernel")

    stand_in.__name__ = name
    return stand_in
