"""Helper processes killed outright (kill -9, the OOM killer) are found and replaced, with a line naming them:
a verifier worker killed between checks (it used to end the run with a BrokenPipeError traceback)."""

from __future__ import annotations

import logging
import os
import signal

from dapo_mcore.rewards.pool import VerifierPool

PAIRS = [("Answer: 4", "4"), ("Answer: 5", "4"), ("Answer: 9", "9")] * 2


def test_a_verifier_worker_killed_between_checks_is_replaced_and_no_check_is_lost(caplog):
    pool = VerifierPool("dapo", workers=2, timeout_s=30)
    try:
        first = pool.verify(PAIRS)
        victim = pool._workers[0].process
        os.kill(victim.pid, signal.SIGKILL)  # while idle: the engine is generating
        victim.join()
        with caplog.at_level(logging.WARNING, logger="dapo_mcore"):
            again = pool.verify(PAIRS)
        assert [v.correct for v in first] == [True, False, True] * 2
        assert [(v.correct, v.error, v.timed_out) for v in again] == [(v.correct, None, False) for v in first]
        assert f"verifier worker pid {victim.pid} died (exit code -9) while idle" in caplog.text
        assert all(w.process.is_alive() for w in pool._workers)
    finally:
        pool.close()


def test_a_verifier_worker_dying_during_a_check_counts_it_wrong_and_is_replaced(caplog):
    pool = VerifierPool("tests.verifiers:die_on_crash", workers=1, timeout_s=30)
    try:
        with caplog.at_level(logging.WARNING, logger="dapo_mcore"):
            verdicts = pool.verify([("Answer: 4", "4"), ("crash", "4"), ("Answer: 4", "4")])
        assert [(v.correct, v.error) for v in verdicts] == [(True, None), (False, "verifier worker died"), (True, None)]
        assert "died (exit code 1) during a check, which counts as wrong" in caplog.text
    finally:
        pool.close()
