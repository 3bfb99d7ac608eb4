"""The verifiers of a run: each data row judged by the verifier of its `data_source` (algorithm.reward.verifiers,
a mapping of source to verifier), rows of any other source by algorithm.reward.verifier.

Each distinct verifier has its own pool (rewards/pool.py: worker processes, timeouts, budgets); a call's checks
are split by pool, run pool after pool, and put back in their order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_mcore.rewards.contract import VERDICTS, ScoreRule
from dapo_mcore.rewards.pool import Check, Verdict, VerifierPool


@dataclass(frozen=True)
class VerifierChoice:
    """Which verifiers judge which rows (default, {source: verifier}), and how their values are read."""

    default: str = "dapo"
    by_source: dict[str, str] = field(default_factory=dict)
    rule: ScoreRule = VERDICTS

    def start(self, **pool_options) -> VerifiersBySource:
        return VerifiersBySource(self.default, self.by_source, self.rule, **pool_options)


class VerifiersBySource:
    """verify(checks) over every row's own verifier; `spec` names them all (errors and warnings say it)."""

    def __init__(self, default: str, by_source: dict[str, str] | None = None, rule: ScoreRule = VERDICTS,
                 **pool_options) -> None:  # fmt: skip
        self.default, self.by_source = default, dict(by_source or {})
        self.pools: dict[str, VerifierPool] = {}
        try:
            for spec in dict.fromkeys([default, *self.by_source.values()]):
                source = next((s for s, v in self.by_source.items() if v == spec), "")
                self.pools[spec] = VerifierPool(spec, rule=rule, probe_row={"data_source": source}, **pool_options)
        except BaseException:
            self.close()
            raise
        routed = ", ".join(f"{source}: {spec}" for source, spec in self.by_source.items())
        self.spec = f"{default} ({routed})" if routed else default

    def spec_of(self, source: str) -> str:
        return self.by_source.get(source, self.default)

    def verify(self, checks: list[Check]) -> list[Verdict]:
        by_spec: dict[str, list[int]] = {}
        for i, check in enumerate(checks):
            source = check[2].get("data_source", "") if len(check) > 2 else ""
            by_spec.setdefault(self.spec_of(source), []).append(i)
        verdicts: list[Verdict | None] = [None] * len(checks)
        for spec, indices in by_spec.items():
            for i, verdict in zip(indices, self.pools[spec].verify([checks[i] for i in indices])):
                verdicts[i] = verdict
        return verdicts  # type: ignore[return-value]

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
