"""Running verifiers with a per-sample timeout, in worker processes, so that no output can hang the job.

A check that outlives `timeout_s` is counted as wrong (and as a timeout); its worker is killed and a fresh
one takes its place. A worker that died (killed, out of memory) is replaced too: found dead before it is given
a check, the check goes to its replacement; dying during a check, that check counts as wrong. A worker is used
once it reports that its verifier is imported, so start-up time never counts against a check. A verifier that
raises counts as wrong and its traceback is kept; one that returns what is no verdict (rewards/contract.py) is
marked invalid, which the caller refuses (rollout/user_functions.py). With workers=0 the checks run in-process without
a timeout (debugging only). Before its first checks a pool has one worker judge PROBE_ANSWER: a verifier that
does not return on it within timeout_s hangs on everything, and stops the run with one line (VerifierHangs).

One call's budget grows with its answers (batch_timeout_s + timeout_per_answer_s x answers / workers): a round
of 12,288 answers must not be cut off where a round of 100 is not. Answers left when it runs out are marked
`unchecked` (wrong, timed out, said in one warning), apart from checks that ran past their own timeout. With
workers=AUTO the pool grows to one worker per ANSWERS_PER_WORKER answers of a call, up to the CPUs this process
may use (host_workers).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from dapo_mcore.rewards.contract import VERDICTS, ScoreRule, call, call_style, read_value
from dapo_mcore.utils.errors import DapoError
from dapo_mcore.utils.imports import import_callable
from dapo_mcore.utils.logging import get_logger
from dapo_mcore.utils.processes import die_with_parent
from dapo_mcore.utils.progress import note

log = get_logger(__name__)

BUILTIN_VERIFIERS = {
    "dapo": "dapo_mcore.rewards.dapo_rule:is_correct",
    "math_verify": "dapo_mcore.rewards.math_verify_rule:is_correct",
    "gsm8k": "dapo_mcore.rewards.gsm8k_rule:is_correct",
    # the verdicts rollout.engine=synthetic drew (rehearsals and tests only)
    "synthetic": "dapo_mcore.rewards.synthetic_rule:is_correct",
}


@dataclass
class Verdict:
    correct: bool
    timed_out: bool = False
    error: str | None = None  # the verifier raised: its traceback (the check counts as wrong)
    invalid: str | None = None  # the verifier returned what is no verdict: what, and what is wanted
    unchecked: bool = False  # never checked: the call's budget ran out first (timed_out too; counts as wrong)
    score: float | None = None  # a graded verifier's score, the reward (rewards/contract.py); None: correct/wrong
    parts: dict[str, float] = field(default_factory=dict)  # the named parts of a dict it returned


# One check: (response, reference) or (response, reference, row), the row a dict (data/types.py Prompt.row).
Check = tuple[str, str] | tuple[str, str, dict]


AUTO = -1  # workers: scaled with the answers of a call (host_workers caps it)
ANSWERS_PER_WORKER = 256
# Judged once, before a pool's first checks: any working verifier returns on it at once (its verdict does not matter).
PROBE_ANSWER = ("Answer: 0", "0")


class VerifierHangs(DapoError):
    """The verifier did not judge the probe answer within timeout_s."""


def host_workers() -> int:
    """Verifier workers this process may run: the CPUs it may use, less one for itself. Under a launcher that
    binds each task to its CPUs (srun --cpu-bind) the affinity mask is the task's own; otherwise it is the node's,
    shared with the other GPU processes of the node (LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE)."""
    usable = len(os.sched_getaffinity(0))
    if usable >= (os.cpu_count() or usable):  # not bound: the node's CPUs, shared
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1")
        usable //= max(1, int(local.split("(")[0] or 1))
    return max(1, usable - 1)


class Verifier:
    """A verifier function with its calling convention and the rule its values are read by."""

    def __init__(self, spec: str, rule: ScoreRule):
        self.fn, self.rule = resolve_verifier(spec), rule
        self.style = call_style(self.fn)

    def check(self, response: str, reference: str, row: dict | None = None) -> Verdict:
        """One check in this process: the verdict, the traceback of an exception, or what was wrong with the
        value."""
        try:
            value = call(self.fn, self.style, response, reference, row)
        except Exception:  # a verifier bug must not kill the worker: counted, and its traceback kept
            return Verdict(correct=False, error=traceback.format_exc())
        try:
            read = read_value(value, self.rule)
        except ValueError as err:
            return Verdict(correct=False, invalid=str(err))
        return Verdict(correct=read.correct, score=read.score, parts=read.parts)


def resolve_verifier(spec: str) -> Callable[..., object]:
    """'dapo', 'math_verify', 'gsm8k', 'synthetic', or 'package.module:function' (rewards/contract.py: its
    signatures and values)."""
    return import_callable(BUILTIN_VERIFIERS.get(spec, spec), what=f"verifier (one of {sorted(BUILTIN_VERIFIERS)} or)")


def _worker_main(conn, spec: str, rule: ScoreRule) -> None:
    die_with_parent()
    verifier = Verifier(spec, rule)
    conn.send("ready")  # deadlines start once the verifier is imported, not while the process starts
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the run is gone (killed): end quietly, not with a traceback
            return
        if task is None:
            return
        index, check = task
        verdict = verifier.check(*check)
        conn.send((index, verdict))


class _Worker:
    def __init__(self, ctx, spec: str, rule: ScoreRule, startup_timeout_s: float):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, spec, rule), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(startup_timeout_s) or self.conn.recv() != "ready":
            self.kill()
            raise DapoError(f"verifier worker for {spec!r} did not start within {startup_timeout_s:.0f} s")

    stopped = False  # killed after a timeout; started anew at its next check

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()
        self.stopped = True


class VerifierPool:
    def __init__(
        self,
        spec: str,
        workers: int = 1,
        timeout_s: float = 10.0,
        startup_timeout_s: float = 120.0,
        batch_timeout_s: float = float("inf"),
        timeout_per_answer_s: float = 0.0,
        rule: ScoreRule = VERDICTS,
        probe_row: dict | None = None,
    ):
        """batch_timeout_s + timeout_per_answer_s x answers / workers: one verify call's budget; past it, the
        checks not done count as timed out (wrong) at once, so that a verifier that hangs costs a step that
        much, not timeout_s per answer in turn. workers: a count, 0 (in-process) or AUTO. rule: how values are
        read (graded, the correct threshold); probe_row: the row the start-up probe is checked with."""
        self.spec, self.n_workers, self.timeout_s, self.rule = spec, workers, timeout_s, rule
        self.probe_row = probe_row or {"data_source": ""}
        self.startup_timeout_s, self.batch_timeout_s = startup_timeout_s, batch_timeout_s
        self.timeout_per_answer_s = timeout_per_answer_s
        self.max_workers = host_workers() if workers == AUTO else workers
        self._cost_said = self._pace_said = False
        self._verifier = Verifier(spec, rule)  # fail fast in the parent on a bad spec
        self._ctx = mp.get_context("spawn")  # no fork of a process holding torch and gloo threads
        self._workers: list[_Worker] = []
        self._timeouts = 0  # checks timed out in the current batch
        self._probed = False

    def workers_for(self, answers: int) -> int:
        if self.n_workers != AUTO:
            return self.n_workers
        return min(self.max_workers, max(1, math.ceil(answers / ANSWERS_PER_WORKER), len(self._workers)))

    def budget_s(self, answers: int) -> float:
        """One call's budget for `answers` checks, with the workers it runs on."""
        return self.batch_timeout_s + self.timeout_per_answer_s * answers / max(1, self.workers_for(answers))

    def verify(self, pairs: list[Check]) -> list[Verdict]:
        if self.n_workers == 0:
            return [self._verifier.check(*check) for check in pairs]
        wanted = self.workers_for(len(pairs))
        if len(self._workers) < wanted:
            self._workers += [self._start() for _ in range(wanted - len(self._workers))]
        if not self._probed:
            self._probe()
        results: list[Verdict | None] = [None] * len(pairs)
        pending, busy = deque(range(len(pairs))), {}  # busy: worker index -> (task index, deadline)
        budget = self.budget_s(len(pairs))
        start = time.monotonic()
        budget_end = start + budget
        self._timeouts = 0
        while pending or busy:
            # the budget is spent (worker restarts included: they start only at a dispatch, and none after it)
            if time.monotonic() >= budget_end and pending:
                self._say_unchecked(len(pending), len(pairs), budget)
                for task in pending:
                    results[task] = Verdict(correct=False, timed_out=True, unchecked=True)
                pending.clear()
            for w in range(len(self._workers)):
                if w not in busy and pending:
                    task = pending.popleft()
                    self._send(w, (task, pairs[task]))
                    busy[w] = (task, min(time.monotonic() + self.timeout_s, budget_end))
            if busy:
                self._collect(busy, results)
                self._expire(busy, results, len(pairs))
                self._watch_pace(len(pairs) - len(pending) - len(busy), len(pairs), start, budget)
        self._say_cost(time.monotonic() - start, len(pairs))
        return results

    def _watch_pace(self, done: int, answers: int, start: float, budget: float) -> None:
        """While a call runs: its progress to the step's progress line (`note`), and, once a run, a warning as soon
        as the pace of the checks done puts the call past its budget (a verifier of 12 s a check passed the
        start-up probe, then the run said nothing for 5 minutes until the budget cut a quarter of the answers
        off as wrong)."""
        elapsed = time.monotonic() - start
        note(f"verifying {done}/{answers} answers ({elapsed:.0f} s of a {budget:.0f} s budget)")
        if self._pace_said or done < max(1, len(self._workers)) or done >= answers or math.isinf(budget):
            return
        projected = elapsed * answers / done
        if projected <= budget:
            return
        self._pace_said = True
        needed = max(0.0, projected - self.batch_timeout_s) * len(self._workers) / answers
        log.warning(
            "verifier %s: %d of %d answers checked in %.0f s; at this pace the call needs about %.0f s, past its "
            "budget of %.0f s (algorithm.reward.batch_timeout_s %g + timeout_per_answer_s %g x %d answers / %d "
            "workers), and the answers left then count as wrong: raise algorithm.reward.timeout_per_answer_s to "
            "%.2g or more, or algorithm.reward.workers",
            self.spec, done, answers, elapsed, projected, budget, self.batch_timeout_s, self.timeout_per_answer_s,
            answers, len(self._workers), 1.2 * needed,
        )  # fmt: skip

    def _say_cost(self, elapsed: float, answers: int) -> None:
        """Once a run: checks that take most of what each answer adds to the budget leave no room (a verifier
        slower than planned, or too few workers) before whole rounds run out of it."""
        cost = elapsed * len(self._workers) / answers if answers >= 16 else 0.0
        if self._cost_said or self.timeout_per_answer_s <= 0 or cost < 0.8 * self.timeout_per_answer_s:
            return
        self._cost_said = True
        log.warning(
            "verifier %s: a check takes %.3f s on average (%d answers in %.1f s on %d workers), near algorithm."
            "reward.timeout_per_answer_s (%g): rounds may run out of their budget; raise it or the workers",
            self.spec, cost, answers, elapsed, len(self._workers), self.timeout_per_answer_s,
        )  # fmt: skip

    def _say_unchecked(self, left: int, answers: int, budget: float) -> None:
        log.warning(
            "verifier %s: %d of %d answers were not checked within this call's budget of %.0f s (algorithm.reward."
            "batch_timeout_s %g + timeout_per_answer_s %g x %d answers / %d workers); they count as wrong: raise "
            "timeout_per_answer_s or algorithm.reward.workers",
            self.spec, left, answers, budget, self.batch_timeout_s, self.timeout_per_answer_s, answers,
            len(self._workers),
        )  # fmt: skip

    def _collect(self, busy, results) -> None:
        next_deadline = min(deadline for _, deadline in busy.values())
        conns = {self._workers[w].conn: w for w in busy}
        for conn in wait(list(conns), timeout=max(0.0, next_deadline - time.monotonic())):
            w = conns[conn]
            try:
                task, verdict = conn.recv()
            except (EOFError, OSError):  # the worker died (crash, out of memory)
                task, verdict = busy[w][0], Verdict(correct=False, error="verifier worker died")
                self._replace_dead(w, "during a check, which counts as wrong")
            results[task] = verdict
            del busy[w]

    def _expire(self, busy, results, answers: int) -> None:
        """Checks past their deadline count as timed out (wrong); their workers are stopped, to be started anew
        at their next check (`_send`, within the batch's budget). The first timeout of a batch is said when it
        happens: a verifier that hangs on every answer said nothing for minutes."""
        now = time.monotonic()
        for w, (task, deadline) in list(busy.items()):
            if now >= deadline:
                results[task] = Verdict(correct=False, timed_out=True)
                self._workers[w].kill()
                del busy[w]
                self._timeouts += 1
                if self._timeouts == 1:
                    log.warning(
                        "verifier %s: a check ran past algorithm.reward.timeout_s (%g s) and was stopped; it counts "
                        "as wrong, and its worker is started anew (this batch: %d answers, a budget of %.0f s)",
                        self.spec, self.timeout_s, answers, self.budget_s(answers),
                    )  # fmt: skip

    def _probe(self) -> None:
        """Once, before the first checks: a verifier that cannot judge a one-line answer within timeout_s hangs
        (waiting on input, a lock, the network), and the run stops here with one line. Found by its checks
        instead, it cost every round its whole budget (300 s and more at the defaults) before a stop, training on
        all-wrong rewards meanwhile."""
        self._probed = True
        worker = self._workers[0]
        worker.conn.send((-1, (*PROBE_ANSWER, self.probe_row)))
        try:
            if worker.conn.poll(self.timeout_s):
                worker.conn.recv()
                return
        except (EOFError, OSError):  # it died: replaced at its first check, which counts as wrong if it dies too
            return
        worker.kill()
        raise VerifierHangs(
            f"algorithm.reward.verifier={self.spec} did not judge a one-line answer ({PROBE_ANSWER[0]!r} against "
            f"{PROBE_ANSWER[1]!r}) within algorithm.reward.timeout_s ({self.timeout_s:g} s): it hangs (waiting on "
            "input, a lock or the network?) or needs more time per check; fix it, or raise the timeout"
        )

    def _send(self, w: int, task: tuple) -> None:
        """Give worker w a task; a worker found dead (killed while idle) is replaced and the task goes to the
        new one."""
        worker = self._workers[w]
        if worker.stopped:  # after a timeout: its restart is counted in the batch's time
            self._workers[w] = self._start()
            self._workers[w].conn.send(task)
            return
        if worker.process.is_alive():
            try:
                worker.conn.send(task)
                return
            except OSError:  # BrokenPipeError: it died just now
                pass
        self._replace_dead(w, "while idle; its next check went to a new worker")
        self._workers[w].conn.send(task)

    def _replace_dead(self, w: int, when: str) -> None:
        process = self._workers[w].process
        process.join(timeout=1)
        log.warning("verifier worker pid %s died (exit code %s) %s", process.pid, process.exitcode, when)
        self._replace(w)

    def _start(self) -> _Worker:
        return _Worker(self._ctx, self.spec, self.rule, self.startup_timeout_s)

    def _replace(self, w: int) -> None:
        self._workers[w].kill()
        self._workers[w] = self._start()

    def close(self) -> None:
        for worker in self._workers:
            if worker.stopped:
                continue
            with contextlib.suppress(OSError):  # the worker may already be gone
                worker.conn.send(None)
            worker.process.join(timeout=1)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []
