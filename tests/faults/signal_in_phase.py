"""The CLI with a signal sent to itself while a chosen phase of a step runs, the phase held a few seconds:

    python tests/faults/signal_in_phase.py PHASE SIGNAL NTH HOLD_S -- CLI ARGS

PHASE is one of PHASES; the signal is sent when the phase begins for the NTH time (1: the first), and the phase
then takes HOLD_S seconds more, so that the signal lands inside it, as a signal from Slurm or a user lands
anywhere. Used by tests/faults/test_signals.py to stop a run in each phase of a step."""

from __future__ import annotations

import functools
import os
import signal
import sys
import time

from dapo_mcore import cli, trainer
from dapo_mcore.mcore.actor import MegatronActor
from dapo_mcore.rollout.sampler import RolloutSampler

# A phase -> (owner, the function or method that is the phase); the trainer's own names where it calls a module
# function (rl_step calls them through the module's globals, so patching the module reaches it).
PHASES = {
    "generation": (RolloutSampler, "next_batch"),
    "old_logprobs": (MegatronActor, "compute_old_logprobs"),
    "update": (MegatronActor, "train_step"),
    "push": (trainer, "push_weights"),
    "save": (trainer, "save"),
}


def signal_in(phase: str, signum: int, nth: int, hold_s: float) -> None:
    owner, name = PHASES[phase]
    original = getattr(owner, name)
    calls = 0

    @functools.wraps(original)
    def phase_with_signal(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == nth:
            os.kill(os.getpid(), signum)
            time.sleep(hold_s)  # the phase goes on after the signal: the handler only records it
        return original(*args, **kwargs)

    setattr(owner, name, phase_with_signal)


if __name__ == "__main__":
    phase, signal_name, nth, hold_s, separator, *cli_args = sys.argv[1:]
    assert separator == "--", sys.argv
    signal_in(phase, getattr(signal, signal_name), int(nth), float(hold_s))
    sys.argv = ["dapo-mcore", *cli_args]
    sys.exit(cli.main())  # as a command: the run's own stop handlers
