"""One RL step's training batch: generate groups, score them, keep the informative ones, repeat.

Each generation round splits its prompts over the engine replicas; each replica scores and filters its share
locally and all-gathers only a summary of each group (rollout/exchange.py), so every rank makes the same
keep decisions and sees the same metrics. Once the step's groups are chosen, their tokens move once, as
tensors, and every rank holds the same batch. Rounds continue until
`prompts_per_step` groups are kept or `max_rounds` is reached. Kept groups beyond the batch are dropped, as
in the DAPO authors' code (verl's recipe/dapo trainer cuts the batch to train_batch_size x n and starts the
next step empty), or with `carry_surplus` trained at the next step instead of being thrown away (REFERENCE.md
section 4, complaint 2): those were sampled by the previous weights, so the step is partly off-policy by one
version, which the clip does not see (old log-probs are recomputed under the current weights; only
algorithm.mismatch's importance weights against the engine's log-probs correct for it). The share is logged
as rollout/off_policy_frac. At the round cap the step
trains on what it kept (warned and logged) or stops with a clear error, as configured; it never crashes on
the cap by accident (complaint 1). Round sizes are fixed, or follow a running keep-rate estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dapo_mcore.algo.dynamic_sampling import KeepRateEstimator, keep_group_mask
from dapo_mcore.data.batching import sample_tokens
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.data.types import Group, Prompt, Sample, accuracy, group_to_dict, token_tensor, value_tensor
from dapo_mcore.rewards.pool import Check, Verdict
from dapo_mcore.rollout.agreement import AgreedVerify, Board, LocalBoard, ReplicaRole, RoundControl
from dapo_mcore.rollout.base import RolloutEngine, SamplingParams
from dapo_mcore.rollout.exchange import (
    EVERY_RANK,
    ExchangeRanks,
    GroupSummary,
    Transport,
    fetch_groups,
    keep_routing_to_send,
    summarize,
)
from dapo_mcore.rollout.partial import (
    QuotaStopper,
    RoundStats,
    answer_requests,
    empty_answers,
    extend_answer,
    partial_metrics,
    split_stale,
)
from dapo_mcore.rollout.pending import PendingGroups, PendingInfo
from dapo_mcore.rollout.placement import ReplicaSplit
from dapo_mcore.rollout.saved_groups import saved_groups
from dapo_mcore.rollout.scoring import GroupScoring
from dapo_mcore.rollout.settings import SamplerSettings
from dapo_mcore.utils.errors import DapoError
from dapo_mcore.utils.logging import get_logger
from dapo_mcore.utils.seeding import derive_seed
from dapo_mcore.utils.timers import PhaseTimer, phase_scope

log = get_logger(__name__)


@dataclass
class RolloutBatch:
    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


class DynamicSamplingCapError(DapoError):
    pass


# The default filter's name before graded rewards (a user's filter may call it).
def correctness_spread(group: Group) -> bool:
    return reward_spread(group)


def reward_spread(group: Group) -> bool:
    """The default filter: the group's verifier rewards (before the length shaping) differ: 0 < accuracy < 1 for
    verdicts (paper eq. 11), any spread of graded scores."""
    return bool(keep_group_mask(torch.tensor([[s.verifier_reward for s in group.samples]]))[0])


class RolloutSampler:
    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,  # the prompt encoder: tokenizer(text).input_ids (e.g. data.templates.PromptFormatter)
        prompts: PromptStream,
        verify: Callable[[list[Check]], list[Verdict]],
        settings: SamplerSettings,
        rank: int,
        world_size: int,
        all_gather: Callable[[Any], list[Any]],
        keep_filter: Callable[[Group], bool] = reward_spread,
        engine_tp_size: int = 1,
        # the all-to-all that moves the chosen groups' tokens (rollout/exchange.py Transport); None: one process
        exchange: Transport | None = None,
        # the data-parallel rank of every rank, and the DP rank that trains each of a step's samples given their
        # token counts in the step's order (build.py, from the actor's DataParallelSplit); None: every rank
        # receives every sample
        dp_rank_of: Sequence[int] | None = None,
        trainers_of: Callable[[list[int]], list[int]] | None = None,
        # values shared between ranks without a collective (parallel.StoreBoard): a partial round's stop and a
        # replica's verdicts (rollout/agreement.py); None: this process alone
        board: Board | None = None,
    ):
        self.engine, self.tokenizer, self.prompts = engine, tokenizer, prompts
        self.settings, self.rank, self.world_size, self.all_gather = settings, rank, world_size, all_gather
        # The ranks of one engine replica (consecutive, engine_tp_size of them) send the same prompts with the
        # same seeds and get the same answers; prompts are split over replicas, not ranks.
        self.engine_tp_size = engine_tp_size
        self.split = ReplicaSplit(rank, world_size, engine_tp_size)
        self.replica, self.n_replicas = self.split.replica, self.split.n_replicas
        self.board = board if board is not None else LocalBoard()
        self.role = ReplicaRole(self.split.replica, self.split.tp_rank, self.split.tp_size)
        # every TP rank of a replica takes its leader's verdicts
        self.scoring = GroupScoring(settings, AgreedVerify(verify, self.board, self.role), keep_filter)
        self.exchange, self.trainers_of = exchange, trainers_of
        self._ranks = ExchangeRanks(rank, engine_tp_size, tuple(dp_rank_of or [0] * world_size))
        self.carry: list[Group] = []
        # Partial rollout: groups with unfinished answers, each held by its replica, continued first next round.
        self.pending = PendingGroups(self.split)
        self._partial_stats: list[RoundStats] = []
        # this replica's kept groups of the step, until the batch is chosen
        self._local: dict[tuple[int, int], Group] = {}
        self.keep_rate = KeepRateEstimator()

    def next_batch(self, step: int, timer: PhaseTimer, on_round: Callable[[], None] = lambda: None) -> RolloutBatch:
        cfg = self.settings
        kept: list[Group | GroupSummary] = list(self.carry)
        generated: list[GroupSummary] = []
        rounds = 0
        stale = self._drop_stale(step)
        if cfg.partial_rollout:  # a carried group's answers may have begun before the last update too
            fresh, too_old = split_stale(self.carry, step, cfg.partial_max_staleness)
            kept, stale = list(fresh), stale + [PendingInfo.of(g) for g in too_old]
        while self._needs_round(len(kept), rounds):
            taken_before = self.prompts.taken
            if cfg.partial_rollout:
                wanted = cfg.prompts_per_step - len(kept)
                summaries = self._generate_partial_round(step, rounds, self._round_size(len(kept)), wanted, timer)
            else:
                summaries = self._generate_round(step, rounds, self._round_size(len(kept)), timer)
            # prompts taken, not groups returned: a partial round returns its finished groups only (KeepRateEstimator)
            self.keep_rate.observe(self.prompts.taken - taken_before, sum(g.keep for g in summaries))
            generated += summaries
            kept += [g for g in summaries if g.keep]
            rounds += 1
            on_round()
        cap_hit = cfg.mode == "resample" and self._handle_cap(kept, step)
        chosen, surplus = kept[: cfg.prompts_per_step], kept[cfg.prompts_per_step :]
        # AReaL's dynamic batch trains on this round's accepted groups only
        carried = surplus if cfg.carry_surplus and cfg.mode != "dynamic_batch" else []
        with timer.phase("exchange"):
            groups = self._fetch(chosen, carried)
        batch_groups, self.carry = groups[: len(chosen)], groups[len(chosen) :]
        self.scoring.assign_advantages(batch_groups)
        metrics = _rollout_metrics(generated, batch_groups, rounds, len(self.carry), cfg)
        # the step's trained answer tokens (every rank's groups, from the summaries every rank holds)
        metrics["rollout/trained_answer_tokens"] = float(sum(s.response_len for g in chosen for s in g.samples))
        metrics["dynamic_sampling/dropped_surplus_groups"] = float(len(surplus) - len(self.carry))
        metrics.update(_policy_lag_metrics(batch_groups, step))
        metrics["dynamic_sampling/cap_hit"] = float(cap_hit)
        metrics["dynamic_sampling/keep_rate_estimate"] = self.keep_rate.rate if self.keep_rate.rate is not None else 1.0
        if cfg.partial_rollout:
            stale_tokens, stale_answers = sum(i.tokens for i in stale), sum(i.answers_begun for i in stale)
            stats, self._partial_stats = self._partial_stats, []
            metrics.update(partial_metrics(stats, stale_answers, stale_tokens, self.pending.total))
        return RolloutBatch(groups=batch_groups, metrics=metrics)

    def _drop_stale(self, step: int) -> list[PendingInfo]:
        """Partial rollout: drop the unfinished groups begun too long ago (every replica's); returns theirs."""
        stale = self.pending.drop_stale(step, self.settings.partial_max_staleness)
        if stale:
            log.info("step %d: dropped %d unfinished groups begun over %d weight versions ago",
                     step + 1, len(stale), self.settings.partial_max_staleness)  # fmt: skip
        return stale

    def _needs_round(self, n_kept: int, rounds: int) -> bool:
        cfg = self.settings
        if cfg.mode == "dynamic_batch":
            return rounds == 0
        return n_kept < cfg.prompts_per_step and (cfg.max_rounds <= 0 or rounds < cfg.max_rounds)

    def _round_size(self, n_kept: int) -> int:
        cfg = self.settings
        if cfg.mode == "dynamic_batch":
            return cfg.prompts_per_step
        if not cfg.dynamic_sampling and not cfg.partial_rollout:
            # nothing is filtered: a round of what the step still needs (GRPO's step). A larger round only left
            # groups over, trained a step later by weights four updates newer (carry_surplus). Partial rollout
            # keeps its round (answers in flight beyond the step's: rollout.partial_oversample).
            return cfg.prompts_per_step - n_kept
        if not cfg.adaptive:
            return cfg.gen_prompts_per_round
        return self.keep_rate.round_size(
            cfg.prompts_per_step - n_kept, cfg.adaptive_min_prompts, cfg.adaptive_max_prompts
        )

    def _generate_round(self, step: int, round_idx: int, n_prompts: int, timer: PhaseTimer) -> list[GroupSummary]:
        """Generate, score and filter this replica's share of a round; every rank gets every group's summary,
        in prompt order. The replica keeps its groups' tokens until the step's batch is chosen."""
        cfg = self.settings
        prompts = self.prompts.take(n_prompts)  # identical on every rank
        mine = self.split.mine(prompts)
        keys = [(round_idx, i) for i in range(len(mine))]
        params = SamplingParams(
            n=cfg.n_samples_per_prompt,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_response_len,
            seed=derive_seed(cfg.seed, step, round_idx, self.replica),
            # each engine-TP rank keeps the routing of the groups it will send, from the engine's output on
            keep_routing=tuple(self._ranks.sender(self.replica, key) == self._ranks.rank for key in keys),
        )
        with timer.phase("generate"):
            groups = self._generate(mine, params, step)
        with timer.phase("reward"):
            self.scoring.score(groups)
        keep = self.scoring.keep_mask(groups)
        kept_groups = {key: g for key, g, kept in zip(keys, groups, keep) if kept}  # only these may move
        summaries = [summarize(g, kept, self.replica, key) for g, kept, key in zip(groups, keep, keys)]
        keep_routing_to_send(kept_groups, self.replica, self._ranks)
        self._local.update(kept_groups)
        del groups  # the unkept ones, with their tokens and routing, go now (most of a 3x round)
        with phase_scope("summaries"):  # every replica's groups of the round, as metadata (no tokens)
            gathered = self.all_gather(summaries)
        # Undo the round-robin split so every rank sees the groups in prompt order (one copy per replica).
        return self.split.in_order(self._from_senders(gathered), len(prompts))

    def _from_senders(self, gathered: list[list[GroupSummary]]) -> list[list[GroupSummary]]:
        """Each replica's summaries of a round, each group's as the rank that sends it made it: that rank alone
        kept the group's routing (its summary has the routing's shape), and its own verdicts decided what it
        keeps to send."""
        tp = self.split.tp_size
        return [
            [gathered[self._ranks.sender(r, s.key)][i] for i, s in enumerate(gathered[r * tp])]
            for r in range(len(gathered) // tp)
        ]

    def _generate_partial_round(
        self, step: int, round_idx: int, n_prompts: int, wanted: int, timer: PhaseTimer
    ) -> list[GroupSummary]:
        """A round that stops once `wanted` groups are kept over every replica. Each replica's inputs: its
        pending groups first, then the new prompts dealt to it, up to the round's size (x partial_oversample)
        over every replica. Returns the summaries of the groups whose answers all ended (rollout/pending.py's
        order); each replica keeps the rest, with their tokens, as its pending groups."""
        cfg = self.settings
        n_new = max(0, math.ceil(n_prompts * cfg.partial_oversample) - self.pending.total)
        new = [Group(p) for p in self.prompts.take(n_new)]  # identical on every rank
        dealt = self.pending.deal_new(len(new))
        mine = self.pending.round_inputs(new, dealt)
        for group in mine:
            if not group.samples:  # a new prompt
                group.samples = empty_answers(
                    self.tokenizer(group.prompt.text).input_ids, cfg.n_samples_per_prompt, step
                )
        requests, slots = answer_requests(
            mine, cfg.max_response_len, derive_seed(cfg.seed, step, round_idx, self.replica)
        )
        stopper = QuotaStopper(mine, slots, wanted, self.scoring.judge, version=step)
        # stops once `wanted` groups are kept over every replica (rollout/agreement.py)
        control = RoundControl(stopper, self.board, self.role, f"round/{step}/{round_idx}", wanted)
        params = SamplingParams(n=1, temperature=cfg.temperature, top_p=cfg.top_p)
        with timer.phase("generate"):
            completions = self.engine.generate_answers(requests, params, control) if requests else []
        groups = [Group(g.prompt, list(g.samples)) for g in mine]
        for slot, completion in zip(slots, completions):
            sample = groups[slot.group].samples[slot.sample]
            groups[slot.group].samples[slot.sample] = extend_answer(sample, completion, step)
        with timer.phase("reward"):
            whole = [i for i, g in enumerate(groups) if all(s.finished for s in g.samples)]
            self.scoring.score_partial([groups[i] for i in whole], [stopper.judged.get(i) for i in whole])
        unjudged = [i for i in whole if i not in stopper.judged]  # ended in the step that stopped the round
        late_keep = self.scoring.keep_mask([groups[i] for i in unjudged])
        keep = stopper.kept | {i for i, kept in zip(unjudged, late_keep) if kept}
        keys = [(round_idx, i) for i in range(len(groups))]
        mine_summaries = [summarize(g, i in keep, self.replica, key) for i, (g, key) in enumerate(zip(groups, keys))]
        kept_groups = {keys[i]: groups[i] for i in keep}  # only these may move
        keep_routing_to_send(kept_groups, self.replica, self._ranks)
        self._local.update(kept_groups)
        with phase_scope("summaries"):
            gathered = self.all_gather((mine_summaries, RoundStats.of(requests, completions)))
        if self.rank == 0:  # every replica has left the round
            control.forget()
        per_replica = self.split.per_replica(gathered)
        self._partial_stats += [stats for _, stats in per_replica]
        shares = [summaries for summaries, _ in per_replica]
        ordered = self.pending.in_order(shares, dealt)
        ended = set(whole)
        self.pending.replace(shares, [g for i, g in enumerate(groups) if i not in ended])
        return [g for g in ordered if g.finished]

    def _generate(self, prompts: list[Prompt], params: SamplingParams, step: int) -> list[Group]:
        if not prompts:
            return []
        prompt_ids = [self.tokenizer(p.text).input_ids for p in prompts]
        outputs = self.engine.generate(prompt_ids, params)
        return [
            Group(
                prompt=p,
                samples=[
                    Sample(
                        prompt_ids=ids,
                        response_ids=token_tensor(c.token_ids),
                        rollout_logprobs=value_tensor(c.logprobs),
                        finish_reason=c.finish_reason,
                        response_text=c.text,
                        policy_step=step,
                        routed_experts=c.routed_experts,
                        routing_dropped=c.routing_dropped,
                    )
                    for c in completions
                ],
            )
            for p, ids, completions in zip(prompts, map(token_tensor, prompt_ids), outputs)
        ]

    def _fetch(self, chosen: list[Group | GroupSummary], carried: list[Group | GroupSummary]) -> list[Group]:
        """The step's batch (`chosen`) and the groups carried to the next step as groups (those carried from the
        previous step already are): the tokens of the summarised ones come from the replicas that generated
        them (collective), each chosen sample to the ranks that train it, carried groups to every rank. The
        step's other generated groups are dropped here."""
        wanted = chosen + carried
        trainers = self._trainers(chosen) + [[EVERY_RANK] * len(g.samples) for g in carried]
        moving = [(g, t) for g, t in zip(wanted, trainers) if isinstance(g, GroupSummary)]
        fetched = iter(
            fetch_groups([g for g, _ in moving], [t for _, t in moving], self._local, self._ranks, self.exchange)
        )
        self._local = {}
        return [next(fetched) if isinstance(g, GroupSummary) else g for g in wanted]

    def _trainers(self, chosen: list[Group | GroupSummary]) -> list[list[int]]:
        """The DP rank that trains each sample of the step's batch, group by group (EVERY_RANK without
        trainers_of)."""
        lengths = [[_sample_tokens(g, i) for i in range(len(g.samples))] for g in chosen]
        if self.trainers_of is None:
            return [[EVERY_RANK] * len(group) for group in lengths]
        flat = iter(self.trainers_of([n for group in lengths for n in group]))
        return [[next(flat) for _ in group] for group in lengths]

    def _handle_cap(self, kept: list[Group | GroupSummary], step: int) -> bool:
        """True when the round cap left the batch short (logged), or a DynamicSamplingCapError in strict mode."""
        cfg = self.settings
        if len(kept) >= cfg.prompts_per_step:
            return False
        message = (  # step: the updates done before this one; users see the step this update completes
            f"step {step + 1}: dynamic sampling kept {len(kept)} of {cfg.prompts_per_step} groups after "
            f"{cfg.max_rounds} rounds (algorithm.dynamic_sampling.max_rounds)"
        )
        if cfg.on_cap == "error":
            raise DynamicSamplingCapError(message + "; stopping as algorithm.dynamic_sampling.on_cap=error asks")
        log.warning(
            message + ("; training on the kept groups" if kept else "; no group to train on, the step makes no update")
        )
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts.state_dict(),
            "carry": [group_to_dict(g) for g in self.carry],
            "keep_rate": self.keep_rate.state_dict(),
            "pending": self.pending.state_dict(),
        }

    def own_files(self) -> dict[str, Any]:
        """What this rank writes into a save as files of its own (name -> object): its replica's pending
        groups (partial rollout), which no other rank holds."""
        return self.pending.own_files()

    def load_state_dict(
        self,
        state: dict[str, Any],
        step: int | None = None,
        read: Callable[[str], Any] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """The sampler of a save made after `step` updates (None: not checked against a step): its carried and
        unfinished groups checked as the run wrote them (saved_groups), a CheckpointError naming what is not.
        `read`: a file of the save by name (own_files' names; the pending groups of partial rollout);
        `vocab_size`: the model's (a token id past it is refused, not sent to the engine)."""
        self.prompts.load_state_dict(state["prompts"])
        self.carry = saved_groups(state["carry"], "carried", step, vocab_size=vocab_size)
        self.keep_rate.load_state_dict(state["keep_rate"])
        if "pending" in state:
            self.pending.load_state_dict(state["pending"], read or _no_files, step, vocab_size)
        else:  # saves before the groups had owners held them all (and saves before partial rollout none)
            self.pending.load_common(
                saved_groups(state.get("unfinished", []), "unfinished", step, vocab_size=vocab_size)
            )
        n = self.settings.n_samples_per_prompt
        other = [g for g in self.carry + self.pending.own if len(g.samples) != n]
        if other and self.rank == 0:
            log.warning("the save holds %d groups of %s answers (carried over or unfinished), where "
                        "rollout.n_samples_per_prompt is now %d: they are trained as they are, the new size from "
                        "the next new prompt on", len(other), sorted({len(g.samples) for g in other}), n)  # fmt: skip


def _no_files(name: str) -> Any:
    raise DapoError(f"the sampler's state names a file of the save ({name}) but no way to read it was given")


def _sample_tokens(group: Group | GroupSummary, i: int) -> int:
    """Prompt + response tokens of sample i of a group, or of the group a summary describes."""
    if isinstance(group, GroupSummary):
        return group.prompt_len + group.samples[i].response_len
    return sample_tokens(group.samples[i])


def _policy_lag_metrics(batch: list[Group], step: int) -> dict[str, float]:
    """How much of the batch older weights sampled (groups carried over from earlier steps, answers continued
    by partial rollout): the share of its samples begun by older weights, the largest lag in weight versions,
    and per token (each tagged with the weights that generated it) the share and the mean lag."""
    lags = [step - s.policy_step for g in batch for s in g.samples]
    if not lags:
        return {}
    token_lags = [(step - version, n) for g in batch for s in g.samples for version, n in s.token_versions()]
    tokens = sum(n for _, n in token_lags)
    return {
        "rollout/off_policy_frac": sum(lag > 0 for lag in lags) / len(lags),
        "rollout/policy_lag_max": float(max(lags)),
        "rollout/off_policy_token_frac": sum(n for lag, n in token_lags if lag > 0) / tokens if tokens else 0.0,
        "rollout/token_lag_mean": sum(lag * n for lag, n in token_lags) / tokens if tokens else 0.0,
    }


def _rollout_metrics(
    generated: list[GroupSummary], batch: list[Group], rounds: int, carried: int, cfg: SamplerSettings
) -> dict[str, float]:
    metrics = {
        "dynamic_sampling/kept_groups": float(len(batch)),
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/carried_groups": float(carried),
        "dynamic_sampling/generated_groups": float(len(generated)),
    }
    samples = [s for g in generated for s in g.samples]
    if not samples:  # the step trained on groups carried over from the previous one
        return metrics
    n = len(samples)
    lengths = [s.response_len for s in samples]
    metrics.update(
        {
            "rollout/accuracy": sum(s.correct for s in samples) / n,
            "rollout/reward_mean": sum(s.reward for s in samples) / n,
            "rollout/response_len_mean": sum(lengths) / n,
            "rollout/response_len_max": float(max(lengths)),
            "rollout/truncated_frac": sum(s.truncated for s in samples) / n,
            "rollout/length_penalty_mean": sum(s.length_penalty for s in samples) / n,
            "rollout/generated_samples": float(n),
            "reward/timeouts": float(sum(s.timed_out for s in samples)),
            "reward/verifier_errors": float(sum(s.verify_error for s in samples)),
        }
    )
    metrics.update(_source_metrics(generated))
    if any(s.routing_shape or s.routing_dropped for s in samples):  # routing replay: the samples without it
        metrics["rollout/routing_dropped"] = float(sum(s.routing_dropped for s in samples))
    if cfg.overlong_enabled:
        zone_start = cfg.max_response_len - cfg.overlong_buffer_len
        metrics["rollout/overlong_zone_frac"] = sum(length > zone_start for length in lengths) / n
    if cfg.dynamic_sampling:
        accuracies = [g.accuracy for g in generated]
        metrics["dynamic_sampling/all_correct_groups"] = float(sum(a == 1.0 for a in accuracies))
        metrics["dynamic_sampling/all_wrong_groups"] = float(sum(a == 0.0 for a in accuracies))
    return metrics


def _source_metrics(generated: list[GroupSummary]) -> dict[str, float]:
    """rollout/accuracy/<source> for each data_source of a file that names them (mixed data), and the mean of each
    named part a verifier returned (reward_part/<name>, over the samples that have it)."""
    metrics: dict[str, float] = {}
    by_source: dict[str, list] = {}
    for g in generated:
        by_source.setdefault(g.prompt.source_label, []).extend(g.samples)
    if any(g.prompt.data_source for g in generated):  # not one unnamed source only
        for label, samples in sorted(by_source.items()):
            metrics[f"rollout/accuracy/{label}"] = accuracy(samples)
    parts: dict[str, list[float]] = {}
    for g in generated:
        for s in g.samples:
            for name, value in s.reward_parts.items():
                parts.setdefault(name, []).append(value)
    metrics.update({f"reward_part/{name}": sum(values) / len(values) for name, values in sorted(parts.items())})
    return metrics
