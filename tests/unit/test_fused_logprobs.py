"""The fused, chunked output layer + log-prob/entropy: exact against the naive computation, and it keeps
nothing of size tokens x vocab for backward."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dapo_mcore.algo.losses import LossSettings, dapo_loss, micro_batch_keep, token_loss_grad, token_loss_terms
from dapo_mcore.mcore.fused_logprobs import chunked_logprobs, chunked_logprobs_with_loss_grad


def naive(hidden, weight, labels, true_vocab, temperature):
    """Full logits: the matmul in the params' dtype, the softmax in (at least) fp32, as Megatron's head."""
    logits = (hidden @ weight.t())[:, :true_vocab].to(torch.promote_types(hidden.dtype, torch.float32))
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_values_and_gradients_match_the_naive_computation_in_float64(chunk):
    torch.manual_seed(0)
    n, h, v_padded, v = 61, 12, 40, 37
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v_padded, h, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    logp, ent = chunked_logprobs(hidden, weight, labels, vocab_start=0, true_vocab=v, temperature=0.7, chunk=chunk)
    ref_logp, ref_ent = naive(hidden, weight, labels, v, 0.7)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    w1, w2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    got = torch.autograd.grad((logp * w1 + ent * w2).sum(), (hidden, weight))
    want = torch.autograd.grad((ref_logp * w1 + ref_ent * w2).sum(), (hidden, weight))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)
    assert got[1][v:].abs().max() == 0  # padded vocab rows get no gradient


def test_gradcheck():
    torch.manual_seed(1)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 8, (5,))
    assert torch.autograd.gradcheck(
        lambda x, w: chunked_logprobs(x, w, labels, vocab_start=0, true_vocab=8, temperature=0.9, chunk=2),
        (hidden, weight),
    )


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while fn runs (excluding leaf inputs, which exist anyway)."""
    total = []

    def pack(t):
        if not (t.is_leaf and t.requires_grad):
            total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(total)


def test_backward_keeps_nothing_of_size_tokens_times_vocab():
    n, h, v = 2048, 16, 1000
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    logits_bytes = n * v * 4
    fused = saved_bytes(lambda: chunked_logprobs(hidden, weight, labels, vocab_start=0, true_vocab=v, chunk=128))
    full = saved_bytes(lambda: naive(hidden, weight, labels, v, 1.0))
    assert full >= logits_bytes  # the naive path keeps (at least) the fp32 logits
    assert fused <= 32 * n  # a few per-token scalars and the labels


# ---- the loss-gradient mode: d hidden and d W taken in the forward chunk loop ---------------------------
def dapo_batch(n_rows, n_cols, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (n_rows, n_cols)
    return {
        "old_logprobs_BT": -3.6 + 0.4 * torch.randn(shape, generator=g, dtype=torch.float64),
        "advantages_BT": torch.randn(n_rows, 1, generator=g, dtype=torch.float64).expand(shape),
        "mask_BT": (torch.rand(shape, generator=g) > 0.2).double(),
        "ref_logprobs_BT": -3.6 + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64),
        "rollout_logprobs_BT": -3.6 + 0.4 * torch.randn(shape, generator=g, dtype=torch.float64),
    }


LOSSES = {
    "token-mean": LossSettings(),
    "token-mean+entropy": LossSettings(entropy_coeff=0.03),
    "seq-mean-token-mean+everything": LossSettings(
        agg_mode="seq-mean-token-mean",
        dual_clip_c=3.0,
        tis="token",
        kl_beta=0.1,
        entropy_coeff=0.02,
        early_stop_ratio=50.0,
    ),
    "seq-mean-token-sum-norm+guard-drops": LossSettings(agg_mode="seq-mean-token-sum-norm", early_stop_ratio=1e-9),
}


def dapo_gradients(
    hidden, weight, labels, s, batch, fused, chunk, scale=1.7, entropy_grad=None, true_vocab=37, head=None
):
    """(logp, entropy, numerator, d hidden, d weight) of scale x dapo_loss's numerator on N = rows x cols tokens.

    fused: the loss-gradient mode; else `head(hidden, weight, labels, **kw)`, by default the recompute path."""
    kw = dict(vocab_start=0, true_vocab=true_vocab, temperature=0.7, chunk=chunk)
    shape = batch["mask_BT"].shape
    loss_kw = dict(ref_logprobs_BT=batch["ref_logprobs_BT"], rollout_logprobs_BT=batch["rollout_logprobs_BT"])
    args = batch["old_logprobs_BT"], batch["advantages_BT"], batch["mask_BT"], s
    if fused:
        terms_N = token_loss_terms(*args, **loss_kw).take(torch.ones(shape).nonzero(as_tuple=True))

        def loss_grad(a, b, logp_C, _entropy_C):
            return token_loss_grad(logp_C, terms_N.take(slice(a, b)), s)

        if entropy_grad is None:  # as the actor does: the one-buffer path when the loss has no entropy term
            entropy_grad = s.entropy_coeff > 0
        logp, ent, anchor = chunked_logprobs_with_loss_grad(
            hidden, weight, labels, loss_grad, entropy_grad=entropy_grad, **kw
        )
    else:
        (logp, ent), anchor = (head or chunked_logprobs)(hidden, weight, labels, **kw), None
    numerator, _, stats = dapo_loss(logp.view(shape), *args, entropy_BT=ent.view(shape), **loss_kw)
    if anchor is not None:
        numerator = numerator + anchor * micro_batch_keep(stats, s)
    grads = torch.autograd.grad(numerator * scale, (hidden, weight))
    return (logp.detach(), ent.detach(), numerator.detach(), *grads)


@pytest.mark.parametrize("entropy_grad", [None, True], ids=["as-needed", "always"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_loss_grad_mode_equals_autograd_through_the_recompute_path_in_float64(chunk, loss, entropy_grad):
    torch.manual_seed(0)
    n_rows, n_cols, h, v_padded = 6, 10, 12, 40
    hidden = torch.randn(n_rows * n_cols, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v_padded, h, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 37, (n_rows * n_cols,))
    batch = dapo_batch(n_rows, n_cols, seed=chunk)
    want = dapo_gradients(hidden, weight, labels, LOSSES[loss], batch, fused=False, chunk=chunk)
    got = dapo_gradients(
        hidden, weight, labels, LOSSES[loss], batch, fused=True, chunk=chunk, entropy_grad=entropy_grad
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)
    if loss.endswith("guard-drops"):
        assert not got[-1].any()
    else:
        assert got[-1].abs().max() > 1e-3 and not got[-1][37:].any()  # padded vocab rows: no gradient


def test_the_one_buffer_path_refuses_a_loss_with_an_entropy_term():
    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    with pytest.raises(ValueError, match="entropy_grad=True"):
        chunked_logprobs_with_loss_grad(
            hidden,
            weight,
            torch.randint(0, 9, (6,)),
            lambda a, b, logp, ent: (torch.ones_like(logp), torch.ones_like(ent)),
            vocab_start=0,
            true_vocab=9,
            entropy_grad=False,
        )


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count, self._running = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Where the CPU mode (a TorchFunctionMode entered in custom backwards) is active, running an op
        # dispatches the same op on the same tensors to this mode again: count it once.
        call = (func, *(id(a) for a in args))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm):
            self.count += call not in self._running
        self._running.append(call)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._running.pop()


@pytest.mark.parametrize("fused, backward_matmuls", [(False, 3 * 8), (True, 0)])
def test_loss_grad_mode_backward_recomputes_no_logits(fused, backward_matmuls, monkeypatch):
    """Recompute path, per chunk of 8: logits again, d hidden and d W; loss-gradient mode: no matmul at all."""
    torch.manual_seed(0)
    hidden = torch.randn(64, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    batch = dapo_batch(8, 8, seed=0)
    loss = LOSSES["token-mean+entropy"]
    counter, real_grad = _CountMatmuls(), torch.autograd.grad

    def counting_grad(*args, **kwargs):  # count inside backward only
        with counter:
            return real_grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting_grad)
    dapo_gradients(hidden, weight, torch.randint(0, 37, (64,)), loss, batch, fused=fused, chunk=8)
    assert counter.count == backward_matmuls


@pytest.mark.parametrize("loss", ["token-mean", "token-mean+entropy"])
def test_loss_grad_mode_in_bfloat16_matches_the_recompute_path(loss):
    """bf16 hidden and weight: every matmul in bf16 as in every path (so log-probs are bit-equal to the old
    log-probs' path), the softmax and dL/dz in fp32. Without an entropy term the entropy metric comes from
    hidden . E_p[W] (E_p[W] from a bf16 matmul), not from the bf16-rounded logits: within 0.06 nats here."""
    torch.manual_seed(0)
    hidden = torch.randn(60, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(40, 64) * 0.3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 37, (60,))
    batch = {k: v.float() for k, v in dapo_batch(6, 10, seed=1).items()}
    want = dapo_gradients(hidden, weight, labels, LOSSES[loss], batch, fused=False, chunk=7)
    got = dapo_gradients(hidden, weight, labels, LOSSES[loss], batch, fused=True, chunk=7)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])  # log-probs, numerator
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0.06)
    for g, w in zip(got[3:], want[3:]):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=0.01 * w.float().abs().max().item())


# ---- the params' dtype: every matmul over the vocab runs in bf16 for a bf16 model ------------------------
_MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "mv", "addmv", "addmv_", "dot", "linear"}


class _RecordVocabMatmuls(TorchDispatchMode):
    """(op, dtypes of its two matrices) of every matmul-family aten call with an operand dimension equal to the
    vocab: the [C, H] x [H, V/tp] logits and the [C, V/tp] x [V/tp, H] and [V/tp, C] x [C, H] gradients."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.calls = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func.overloadpacket.__name__ in _MATMULS and any(self.vocab in t.shape for t in tensors):
            self.calls.append((func.overloadpacket.__name__, *(t.dtype for t in tensors[-2:])))  # addmm: not self
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["recompute", "loss-grad", "loss-grad+entropy"])
def test_head_matmuls_run_in_the_params_dtype(path):
    """A bf16 model: the logits matmul and the d hidden and d W matmuls all take bf16 operands (an H100 runs
    fp32 matmuls at a fraction of its bf16 rate); only the softmax and its per-token sums are in fp32."""
    torch.manual_seed(0)
    n, h, v = 300, 64, 1000
    hidden = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h) * 0.3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,))
    kw = dict(vocab_start=0, true_vocab=v, temperature=0.7, chunk=128)
    recorder = _RecordVocabMatmuls(v)
    with recorder:
        if path == "recompute":
            logp, ent = chunked_logprobs(hidden, weight, labels, **kw)
            loss = (logp + 0.1 * ent).sum()
        else:
            with_entropy = path == "loss-grad+entropy"

            def loss_grad(a, b, logp_C, entropy_C):
                return -torch.ones_like(logp_C), 0.1 * torch.ones_like(entropy_C) if with_entropy else None

            loss = chunked_logprobs_with_loss_grad(hidden, weight, labels, loss_grad, entropy_grad=with_entropy, **kw)[
                2
            ]
        grads = torch.autograd.grad(loss, (hidden, weight))
    assert all(g.dtype == torch.bfloat16 for g in grads)
    assert len(recorder.calls) >= 3 * 3  # 3 chunks: logits, d hidden, d W (recompute: and the forward's logits)
    assert [c for c in recorder.calls if c[1:] != (torch.bfloat16, torch.bfloat16)] == []


def full_logits(hidden, weight, labels, *, true_vocab, temperature, **_):
    return naive(hidden, weight, labels, true_vocab, temperature)


BF16_CASES = ["recompute: logp and entropy terms", "loss-grad: DAPO token-mean", "loss-grad: DAPO token-mean+entropy"]


def case_outputs(case, hidden, weight, labels, fused):
    """(logp, entropy, d hidden, d weight) of `case`'s loss, by the fused head or (fused=False) full logits."""
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    kw = dict(vocab_start=0, true_vocab=weight.shape[0] - 3, temperature=0.7, chunk=128)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    if case.startswith("recompute"):
        logp, ent = (chunked_logprobs if fused else full_logits)(hidden, weight, labels, **kw)
        w_2N = torch.randn(2, hidden.shape[0], generator=torch.Generator().manual_seed(1)).to(acc)
        grads = torch.autograd.grad((logp * w_2N[0] + ent * w_2N[1]).sum(), (hidden, weight))
        return logp.detach(), ent.detach(), *grads
    batch = {k: v.float().to(acc) for k, v in dapo_batch(10, hidden.shape[0] // 10, seed=2).items()}
    logp, ent, _, *grads = dapo_gradients(
        hidden,
        weight,
        labels,
        LOSSES[case.split()[-1]],
        batch,
        fused=fused,
        chunk=kw["chunk"],
        true_vocab=kw["true_vocab"],
        head=full_logits,
    )
    return logp, ent, *grads


@pytest.mark.parametrize("case", BF16_CASES)
def test_bfloat16_head_is_as_accurate_as_full_bfloat16_logits(case):
    """The bf16 fused head against the float64 computation on the same (bf16) hidden and weight: log-probs,
    entropies, d hidden and d W. bf16 matmuls cost precision, and the reference for how much is acceptable is
    what a full-logits bf16 head (Megatron's: logits and their gradient matmuls in bf16, softmax in fp32)
    loses on the same inputs. Its error is dominated by the bf16 rounding of the logits (|z| ~ 10 here: an ulp
    of 0.06) and of the gradients handed back in bf16; the fused head shares both roundings, adds that of e or
    dL/dz to bf16 before its matmuls, of d W's chunk products, and (one-buffer path) of E_p[W] in its entropy.
    So each output's max error may be at most 2x that of full bf16 logits, plus a floor of 1e-3 of the
    output's largest magnitude (so that an output full logits happens to get nearly exact cannot fail it)."""
    torch.manual_seed(0)
    n, h, v = 300, 64, 1000
    hidden = torch.randn(n, h).to(torch.bfloat16)
    weight = (torch.randn(v + 3, h) * 0.3).to(torch.bfloat16)  # 3 padded vocab rows
    labels = torch.randint(0, v, (n,))
    exact = case_outputs(case, hidden.double(), weight.double(), labels, fused=False)
    full = case_outputs(case, hidden, weight, labels, fused=False)
    got = case_outputs(case, hidden, weight, labels, fused=True)
    for name, g, f, x in zip(("logp", "entropy", "d hidden", "d weight"), got, full, exact):
        assert g.dtype == f.dtype
        err_fused, err_full = ((t.double() - x).abs().max().item() for t in (g, f))
        assert err_fused <= 2 * err_full + 1e-3 * x.abs().max().item(), (name, err_fused, err_full)
    assert not got[3][v:].any()  # padded vocab rows: no gradient
