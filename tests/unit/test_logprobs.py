import pytest
import torch

from dapo_mcore.mcore.logprobs import vocab_parallel_logprobs


def naive(logits, labels, true_vocab, temperature):
    z = logits[..., :true_vocab] / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_single_rank_values_and_gradients_match_the_naive_computation_in_float64(temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (3, 7))
    logp, ent = vocab_parallel_logprobs(logits, labels, vocab_start=0, true_vocab=13, temperature=temperature)
    ref_logp, ref_ent = naive(logits, labels, 13, temperature)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    w_logp, w_ent = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    grad = torch.autograd.grad((logp * w_logp + ent * w_ent).sum(), logits)[0]
    ref_grad = torch.autograd.grad((ref_logp * w_logp + ref_ent * w_ent).sum(), logits)[0]
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    assert grad[..., 13:].abs().max() == 0  # padded vocab columns get no gradient


def test_gradcheck_through_the_custom_backward():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs(x, labels, vocab_start=0, true_vocab=5, temperature=0.8), (logits,)
    )


def test_bf16_logits_are_computed_in_fp32_and_return_grads_in_bf16():
    logits = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    logp, _ = vocab_parallel_logprobs(logits, torch.zeros(4, dtype=torch.long), vocab_start=0, true_vocab=32)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
