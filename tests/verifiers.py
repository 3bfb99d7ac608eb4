"""Verifiers and filters for tests, importable by 'tests.verifiers:name' (kept free of heavy imports, since
verifier worker processes import this module)."""

import time

from dapo_mcore.rewards.dapo_rule import is_correct


def hang_on_hmm(response: str, reference: str) -> bool:
    """Never returns for responses containing 'hmm' (as a check on a degenerate output might)."""
    if "hmm" in response:
        time.sleep(3600)
    return is_correct(response, reference)


def never_returns(response: str, reference: str) -> bool:
    """Hangs on every answer (a verifier waiting on input, a lock or the network)."""
    time.sleep(3600)
    return False


def keep_even_sums(group) -> bool:
    """A custom dynamic-sampling filter: keep groups whose answer is even."""
    return int(group.prompt.answer) % 2 == 0


def raise_on_boom(response: str, reference: str) -> bool:
    if "boom" in response:
        raise ValueError("verifier bug")
    return is_correct(response, reference)


def always_raise(response: str, reference: str) -> bool:
    """A verifier with a bug on every answer (every reward was -1 without a word)."""
    raise KeyError("reference_answer")


def raise_on_odd_length(response: str, reference: str) -> bool:
    """A verifier with a bug on some answers only."""
    if len(response) % 2:
        raise KeyError("reference_answer")
    return is_correct(response, reference)


def string_false(response: str, reference: str) -> str:
    """Returns "False", which bool() takes for true: every answer was right."""
    return "False"


def not_a_number(response: str, reference: str) -> float:
    return float("nan")


def a_score(response: str, reference: str) -> float:
    """A verifier that returns a number in [0, 1]: correct from 0.5."""
    return 0.75 if is_correct(response, reference) else 0.25


def die_on_crash(response: str, reference: str) -> bool:
    """Kills its own process, as a segfault or the OOM killer would."""
    import os

    if "crash" in response:
        os._exit(1)
    return is_correct(response, reference)


def raise_in_filter(group) -> bool:
    """A dynamic-sampling filter with a bug: it raises on every group."""
    raise ValueError(f"filter bug: no rule for {group.prompt.uid}")


def says_no(group) -> str:
    """A dynamic-sampling filter that returns a string: bool("no") is True, so every group was kept."""
    return "no"


def drop_every_group(group) -> bool:
    """A dynamic-sampling filter that keeps nothing: every step hits the round cap."""
    return False


def kill_checkpoint_writer_manager(group) -> bool:
    """A dynamic-sampling filter (the demo's own rule) that kills the manager process behind Megatron's
    checkpoint write-results queue with SIGKILL (as the OOM killer might), once in step 1 and once in step 2
    (told by the rows in metrics.jsonl), writing its pid to <run dir>/killed-N. Runs in the trainer process;
    finds its run directory in the command's arguments."""
    import os
    import signal

    from dapo_mcore.checkpoint import writer_processes
    from dapo_mcore.rollout.sampler import reward_spread

    run_dir, step = _run_dir_and_step()
    marker = run_dir / f"killed-{step}"
    if step in (1, 2) and not marker.exists():
        process = writer_processes._WRITER_MANAGER._process
        marker.write_text(str(process.pid))
        os.kill(process.pid, signal.SIGKILL)
        process.join()
    return reward_spread(group)


def spread_pausing_in_the_first_attempt(group) -> bool:
    """The demo's own filter (reward_spread) that pauses DAPO_TEST_STEP_PAUSE seconds (default 0) at the first
    group of each step (told by the rows in metrics.jsonl) in a Slurm job's first attempt (SLURM_RESTART_COUNT
    unset or 0): slower steps that compute exactly the same thing, so that the attempt outlasts its time limit with
    few steps while the re-queued attempt runs at full speed. Runs in the trainer processes; finds its run
    directory in the command's arguments."""
    import os

    from dapo_mcore.rollout.sampler import reward_spread

    pause = float(os.environ.get("DAPO_TEST_STEP_PAUSE", "0"))
    if pause > 0 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        _, step = _run_dir_and_step()
        if step not in _PAUSED_STEPS:
            _PAUSED_STEPS.add(step)
            time.sleep(pause)
    return reward_spread(group)


_PAUSED_STEPS: set[int] = set()


def _run_dir_and_step():
    """In a trainer process: its run directory (from the command's arguments) and the step it is in (the rows
    in metrics.jsonl so far)."""
    import sys
    from pathlib import Path

    run_dir = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("logging.run_dir=")))
    metrics = run_dir / "metrics.jsonl"
    return run_dir, len(metrics.read_text().splitlines()) if metrics.exists() else 0


def slow_on_rank_1(response: str, reference: str) -> bool:
    """The DAPO rule, but on rank 1 every check outlasts a short algorithm.reward.timeout_s (counts as wrong), as
    one node's loaded verifier pool would, while rank 0's pass: two TP ranks of one engine judging alone disagree."""
    import os

    if os.environ.get("RANK") == "1":
        time.sleep(2.0)
    return is_correct(response, reference)


def kill_rank_1_in_step_2(group) -> bool:
    """The demo's own filter, except that rank 1 kills itself with SIGKILL in step 2 (as the out-of-memory killer
    would): what its survivors say about it (tests/dist/test_dead_rank.py)."""
    import os
    import signal

    from dapo_mcore.rollout.sampler import reward_spread

    if os.environ.get("RANK") == "1" and _run_dir_and_step()[1] >= 1:  # one row in metrics.jsonl: step 2
        os.kill(os.getpid(), signal.SIGKILL)
    return reward_spread(group)


def slow_check(response: str, reference: str) -> bool:
    """The DAPO rule at 0.1 s a check: a verifier as slow as a symbolic one on long answers."""
    time.sleep(0.1)
    return is_correct(response, reference)
