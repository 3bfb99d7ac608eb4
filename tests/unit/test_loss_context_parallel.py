"""The loss over context-parallel ranks (docs/design/context_parallel.md section 5): a micro-batch's columns cut
over two ranks, each running dapo_loss on its columns with a SequenceShards whose `sum` totals the two ranks'
partial sums (two threads meeting at a barrier, as an all-reduce would), gives numerators, denominators, statistics
and d numerator / d log-probs that add up to the whole micro-batch's: for every aggregation, policy loss, rollout
correction and the early-stop guard, unfused and in the fused head's per-token form."""

import itertools
import threading

import pytest
import torch

from dapo_mcore.algo.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    TIS_MODES,
    LossSettings,
    SequenceShards,
    dapo_loss,
    dapo_loss_grad,
    stat_keys,
)
from dapo_mcore.data.batching import row_cp_columns

pytestmark = pytest.mark.unit
CP = 2


class Meeting:
    """CP ranks as threads: `sum_for(rank)` totals a partial sum over the ranks (the same order on each)."""

    def __init__(self, n: int):
        self.barrier, self.parts = threading.Barrier(n), [None] * n

    def sum_for(self, rank: int):
        def total(partial: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = partial.detach().clone()
            self.barrier.wait()
            out = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()  # every rank has read before the next call writes
            return out

        return total


def batch(seed: int, b: int = 3, t: int = 12) -> dict:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    mask = (torch.rand(b, t, generator=gen) > 0.3).double()
    mask[-1] = 0.0  # a sequence without loss tokens
    return {
        "logp": old + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64),
        "old": old,
        "adv": torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, t).clone(),
        "mask": mask,
        "rollout": old + 0.2 * torch.randn(b, t, generator=gen, dtype=torch.float64),
        "entropy": torch.rand(b, t, generator=gen, dtype=torch.float64),
    }


def run_rank(x: dict, s: LossSettings, cols: torch.Tensor, shards: SequenceShards, out: dict) -> None:
    logp = x["logp"][:, cols].clone().requires_grad_()
    num, den, stats = dapo_loss(
        logp, x["old"][:, cols], x["adv"][:, cols], x["mask"][:, cols], s, entropy_BT=x["entropy"][:, cols],
        rollout_logprobs_BT=x["rollout"][:, cols], shards=shards,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(num, logp) if num.requires_grad else (torch.zeros_like(logp),)
    fused, _ = dapo_loss_grad(
        x["logp"][:, cols], x["old"][:, cols], x["adv"][:, cols], x["mask"][:, cols], s,
        rollout_logprobs_BT=x["rollout"][:, cols], shards=shards,
    )  # fmt: skip
    out.update(num=num.detach(), den=den, stats=stats, grad=grad, fused=fused)


# the early-stop guard at the whole micro-batch's mean ratio: kept whole, while a rank judging by its own columns
# alone would drop its half where that half's mean is higher
CASES = list(itertools.product(LOSS_AGG_MODES, POLICY_LOSSES, TIS_MODES, (False, True)))


def mean_ratio(x: dict) -> float:
    ratio = (x["logp"] - x["old"]).exp()
    return float((ratio * x["mask"]).sum() / x["mask"].sum())


@pytest.mark.parametrize("mode, policy_loss, tis, early_stop", CASES)
def test_two_cp_ranks_add_up_to_the_whole_micro_batch(mode, policy_loss, tis, early_stop):
    for seed in (0, 1):
        x = batch(seed)
        s = LossSettings(agg_mode=mode, policy_loss=policy_loss, tis=tis, norm_len=7, entropy_coeff=0.01,
                         early_stop_ratio=mean_ratio(x) + 1e-9 if early_stop else None,
                         gspo_clip_low=0.2, gspo_clip_high=0.28, seq_mask_low=0.97, seq_mask_high=1.03)  # fmt: skip
        whole: dict = {}
        run_rank(x, s, torch.arange(x["logp"].shape[1]), SequenceShards(), whole)
        meeting, outs = Meeting(CP), [{} for _ in range(CP)]
        cols = [row_cp_columns(x["logp"].shape[1], CP, r) for r in range(CP)]
        threads = [
            threading.Thread(
                target=run_rank, args=(x, s, cols[r], SequenceShards(meeting.sum_for(r), lead=r == 0), outs[r])
            )
            for r in range(CP)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        torch.testing.assert_close(sum(o["num"] for o in outs), whole["num"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sum(o["den"] for o in outs), whole["den"], rtol=1e-12, atol=1e-12)
        for key in stat_keys(s):
            got = sum(torch.as_tensor(o["stats"][key]) for o in outs)
            torch.testing.assert_close(got, torch.as_tensor(whole["stats"][key]), rtol=1e-12, atol=1e-12, msg=key)
        for name in ("grad", "fused"):
            got = torch.zeros_like(whole[name])
            for r in range(CP):
                got[:, cols[r]] = outs[r][name]
            torch.testing.assert_close(got, whole[name], rtol=1e-12, atol=1e-12, msg=name)
