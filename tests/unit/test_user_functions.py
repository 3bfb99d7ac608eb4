"""A verifier or dynamic-sampling filter of the config's that raises is named as such, with its config key, its
'module:function' and the exception (UserCodeError, exit 2), also when it raised inside the engine's step loop
(partial rollout), where it was reported as "rollout engine 'hf' failed" (exit 3); and in a synchronous round,
where it was a traceback (exit 1)."""

import pytest

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.agreement import AgreedVerify, LocalBoard, ReplicaRole
from dapo_mcore.rollout.guard import GuardedEngine
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings
from dapo_mcore.rollout.user_functions import function_name
from dapo_mcore.utils.errors import BAD_INPUT_EXIT_CODE, UserCodeError
from dapo_mcore.utils.timers import PhaseTimer
from tests.helpers import FakeTokenizer, LongTailEngine
from tests.unit.test_partial_rollout import SETTINGS, heavy_tail
from tests.verifiers import raise_in_filter, says_no
from tests.warm_cli import cli_env, run_warm


def broken_verify(pairs):
    raise RuntimeError("verdict table\nmissing")


def sampler(partial, keep_filter=raise_in_filter, verify=None):
    settings = SamplerSettings(**{**SETTINGS, "partial_rollout": partial})
    return RolloutSampler(
        GuardedEngine("hf", lambda: LongTailEngine(heavy_tail)), FakeTokenizer(),
        PromptStream(ArithmeticTask(0, 99), seed=0), verify or VerifierPool("dapo", workers=0).verify, settings,
        rank=0, world_size=1, all_gather=lambda obj: [obj], keep_filter=keep_filter,
    )  # fmt: skip


@pytest.mark.parametrize("partial", [True, False], ids=["partial rollout", "synchronous"])
def test_a_filter_that_raises_is_named_not_the_engine(partial):
    with pytest.raises(UserCodeError) as err:
        sampler(partial).next_batch(0, PhaseTimer())
    message = str(err.value)
    assert message.startswith(
        "algorithm.dynamic_sampling.filter=tests.verifiers:raise_in_filter raised ValueError: filter bug: no rule for "
        "arith-"
    )
    assert "on the group of prompt arith-" in message and "engine" not in message
    assert isinstance(err.value.__cause__, ValueError) and err.value.exit_code == BAD_INPUT_EXIT_CODE == 2
    assert not err.value.same_on_every_rank  # printed by the rank whose replica judged the group


def test_a_verify_that_raises_inside_the_engine_loop_is_named_not_the_engine():
    with pytest.raises(UserCodeError) as err:
        sampler(True, keep_filter=lambda group: True, verify=broken_verify).next_batch(0, PhaseTimer())
    assert str(err.value).startswith(
        "algorithm.reward.verifier=tests.unit.test_user_functions:broken_verify raised RuntimeError: missing "
        "(checking 4 answers;"
    )


def test_the_verifier_is_named_by_its_spec_behind_the_pool_and_the_tp_agreement():
    pool = VerifierPool("tests.verifiers:raise_on_boom", workers=0)
    assert function_name(pool.verify) == "tests.verifiers:raise_on_boom"
    assert function_name(AgreedVerify(pool.verify, LocalBoard(), ReplicaRole(0))) == "tests.verifiers:raise_on_boom"
    assert function_name(raise_in_filter) == "tests.verifiers:raise_in_filter"


@pytest.mark.parametrize("partial", ["true", "false"])
def test_the_run_ends_with_one_line_naming_the_filter_and_exit_2(partial, tmp_path):
    proc = run_warm(
        [
            "train", "examples/smoke_cpu.yaml", "trainer.steps=1", f"rollout.partial_rollout={partial}",
            "algorithm.dynamic_sampling.filter=tests.verifiers:raise_in_filter", f"logging.run_dir={tmp_path}/run",
            "logging.wandb.mode=disabled", "logging.plot=false",
        ],
        cli_env(),
        300,
    )  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last.startswith("dapo-mcore: error: algorithm.dynamic_sampling.filter=tests.verifiers:raise_in_filter "
                           "raised ValueError: filter bug"), last  # fmt: skip
    assert "rollout engine" not in proc.stderr


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tests.verifiers:string_false", "returned 'False' (str): a verifier returns a bool, a number in [0, 1]"),
        ("tests.verifiers:not_a_number", "returned nan (float): a verifier returns a bool"),
    ],
)
@pytest.mark.parametrize("workers", [0, 1])
def test_a_verifier_value_that_is_no_verdict_stops_the_run_naming_it(spec, message, workers):
    """bool("False") and bool(nan) are True: every answer was right, without a word."""
    verify = VerifierPool(spec, workers=workers).verify
    with pytest.raises(UserCodeError) as err:
        sampler(False, keep_filter=lambda group: True, verify=verify).next_batch(0, PhaseTimer())
    assert str(err.value).startswith(f"algorithm.reward.verifier={spec} {message}"), str(err.value)


def test_a_number_in_zero_one_is_a_verdict_correct_from_one_half():
    assert [
        v.correct for v in VerifierPool("tests.verifiers:a_score", workers=0).verify([("x", "1"), ("Answer: 1", "1")])
    ] == [
        False,
        True,
    ]


def test_a_verifier_that_raises_on_every_answer_stops_the_run_with_its_traceback_logged_once(caplog):
    verify = VerifierPool("tests.verifiers:always_raise").verify
    with pytest.raises(UserCodeError) as err:
        sampler(False, keep_filter=lambda group: True, verify=verify).next_batch(0, PhaseTimer())
    assert "algorithm.reward.verifier=tests.verifiers:always_raise raised on every one of" in str(err.value)
    assert "KeyError: 'reference_answer'; its first traceback is logged above" in str(err.value)
    logged = [r.getMessage() for r in caplog.records if "its first traceback" in r.getMessage()]
    assert len(logged) == 1 and 'raise KeyError("reference_answer")' in logged[0]


def test_a_verifier_that_raises_on_some_answers_is_counted_and_the_run_goes_on(caplog):
    verify = VerifierPool("tests.verifiers:raise_on_odd_length", workers=0).verify
    s = sampler(False, keep_filter=lambda group: True, verify=verify)
    metrics = [s.next_batch(step, PhaseTimer()).metrics for step in range(2)]
    assert all(m["reward/verifier_errors"] > 0 for m in metrics)
    assert len([r for r in caplog.records if "its first traceback" in r.getMessage()]) == 1  # once a run


@pytest.mark.parametrize("partial", [True, False], ids=["partial rollout", "synchronous"])
def test_a_filter_that_returns_no_bool_stops_the_run_naming_it_and_the_value(partial):
    with pytest.raises(UserCodeError) as err:
        sampler(partial, keep_filter=says_no).next_batch(0, PhaseTimer())
    assert str(err.value).startswith(
        "algorithm.dynamic_sampling.filter=tests.verifiers:says_no returned 'no' (str) on the group of prompt arith-"
    ), str(err.value)
    assert str(err.value).endswith("a dynamic-sampling filter returns a bool (True: keep the group)")


def test_a_batch_of_checks_that_hang_ends_at_its_budget_each_counted_timed_out():
    """A verifier that never returns cost timeout_s per answer in turn (about 53 minutes a step of the demo):
    the batch's budget ends it, every check left counted as timed out."""
    import time

    pool = VerifierPool("tests.verifiers:hang_on_hmm", workers=1, timeout_s=1.0, batch_timeout_s=2.5)
    try:
        start = time.monotonic()
        verdicts = pool.verify([("hmm", "1")] * 10)
        elapsed = time.monotonic() - start
    finally:
        pool.close()
    assert all(v.timed_out and not v.correct for v in verdicts)
    assert elapsed < 7.0  # 10 checks x 1 s each without the budget


def test_timeouts_are_logged_once_with_the_answer_length_and_many_in_a_row_stop_the_run(caplog):
    from dapo_mcore.rewards.pool import Verdict
    from dapo_mcore.rollout.user_functions import TIMEOUTS_IN_A_ROW, VerdictCheck

    check = VerdictCheck(VerifierPool("tests.verifiers:hang_on_hmm", workers=0).verify)
    timed_out, fine = Verdict(correct=False, timed_out=True), Verdict(correct=True)
    check([timed_out, fine] * 20, "round 1", ["x" * 1234, "y"] * 20)  # never two in a row: the run goes on
    warnings = [r.getMessage() for r in caplog.records if "ran past algorithm.reward.timeout_s" in r.getMessage()]
    assert len(warnings) == 1 and "on an answer of 1,234 characters (round 1)" in warnings[0]
    with pytest.raises(UserCodeError) as err:
        check([timed_out] * TIMEOUTS_IN_A_ROW, "round 2")
    assert str(err.value).startswith(
        f"algorithm.reward.verifier=tests.verifiers:hang_on_hmm timed out on {TIMEOUTS_IN_A_ROW} answers in a row "
        "(round 2)"
    )


def test_a_verifier_worker_whose_run_is_gone_ends_without_a_traceback(capfd):
    """After a kill of the run, its verifier workers printed an EOFError traceback on their way out."""
    import multiprocessing as mp

    from dapo_mcore.rewards.contract import VERDICTS
    from dapo_mcore.rewards.pool import _Worker

    worker = _Worker(mp.get_context("spawn"), "dapo", VERDICTS, startup_timeout_s=120)
    worker.conn.close()  # as when the run's process is gone
    worker.process.join(timeout=30)
    assert worker.process.exitcode == 0
    assert "Traceback" not in capfd.readouterr().err
