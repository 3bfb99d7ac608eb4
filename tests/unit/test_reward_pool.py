import time

import pytest

from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.utils.errors import ConfigError


@pytest.fixture
def pool_factory():
    pools = []

    def make(spec, **kwargs):
        pools.append(VerifierPool(spec, **kwargs))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


def test_a_hung_check_times_out_counts_as_wrong_and_the_others_still_finish(pool_factory):
    pool = pool_factory("tests.verifiers:hang_on_hmm", workers=2, timeout_s=0.5)
    start = time.monotonic()
    verdicts = pool.verify([("Answer: 3", "3"), ("hmm Answer: 3", "3"), ("Answer: 4", "3"), ("hmm", "1")])
    assert time.monotonic() - start < 5
    assert [(v.correct, v.timed_out) for v in verdicts] == [(True, False), (False, True), (False, False), (False, True)]
    assert [v.correct for v in pool.verify([("Answer: 1", "1")] * 3)] == [True] * 3  # replaced workers work


def test_a_raising_verifier_counts_as_wrong_and_keeps_its_error(pool_factory):
    pool = pool_factory("tests.verifiers:raise_on_boom", workers=1)
    verdicts = pool.verify([("boom", "1"), ("Answer: 1", "1")])
    assert verdicts[0].correct is False and "ValueError: verifier bug" in verdicts[0].error
    assert verdicts[1].correct is True


def test_a_dying_worker_is_replaced(pool_factory):
    pool = pool_factory("tests.verifiers:die_on_crash", workers=1)
    verdicts = pool.verify([("crash", "1"), ("Answer: 1", "1")])
    assert verdicts[0].error == "verifier worker died" and verdicts[1].correct


def test_in_process_mode_needs_no_workers(pool_factory):
    assert pool_factory("dapo", workers=0).verify([("Answer: 2", "2")])[0].correct


@pytest.mark.parametrize(
    "spec, message",
    [("nonsense", "must be given as 'package.module:function'"), ("tests.verifiers:absent", "cannot be loaded")],
)
def test_bad_verifier_specs_are_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        VerifierPool(spec)
