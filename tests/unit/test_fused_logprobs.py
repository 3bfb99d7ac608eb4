"""The fused, chunked output layer + log-prob/entropy: exact against the naive computation, and it keeps
nothing of size tokens x vocab for backward."""

import pytest
import torch

from dapo_mcore.mcore.fused_logprobs import chunked_logprobs


def naive(hidden, weight, labels, true_vocab, temperature):
    logp = torch.log_softmax((hidden @ weight.t())[:, :true_vocab] / temperature, dim=-1)
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
