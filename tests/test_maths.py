"""The maths, against hand computations: reward, advantages, masks, log-probs, loss and its normalisations."""
import math

import pytest
import torch

import grpo_ssr as g


def test_reward_len_hand_values():
    assert g.reward_len(["a" * 20, "a" * 5, "a" * 31, ""]) == [0.0, -15.0, -11.0, -20.0]
    chat = [[{"role": "assistant", "content": "x" * 18}]]
    assert g.reward_len(chat) == [-2.0]
    assert g.reward_len_binary(["a" * 18, "a" * 22, "a" * 17, "a" * 23]) == [1.0, 1.0, 0.0, 0.0]


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    # group 1: mean 3, unbiased std sqrt(((-2)^2 + 1 + 0 + 9) / 3) = sqrt(14/3); group 2: no spread
    std = math.sqrt(14 / 3)
    expected = torch.tensor([-2 / (std + 1e-4), -1 / (std + 1e-4), 0.0, 3 / (std + 1e-4), 0, 0, 0, 0])
    assert torch.allclose(g.group_advantages(rewards, 4, scale_rewards=True), expected, atol=1e-6)
    unscaled = g.group_advantages(rewards, 4, scale_rewards=False)
    assert unscaled.tolist() == [-2.0, -1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    assert g.zero_spread_groups(rewards, 4).tolist() == [False, True]


def test_zero_spread_advantage_is_exactly_zero():
    # 0.1 * 3 is not exactly representable: a naive r - mean(r) leaves rounding residue; we promise exact zeros.
    rewards = torch.full((6,), 0.1)
    adv = g.group_advantages(rewards, 3, scale_rewards=True)
    assert (adv == 0).all()


def test_completion_mask_from_eos():
    eos = 9
    ids = torch.tensor([[1, 2, 9, 4, 9],
                        [9, 1, 1, 1, 1],
                        [1, 2, 3, 4, 5]])
    mask = g.completion_mask_from_eos(ids, eos)
    assert mask.tolist() == [[1, 1, 1, 0, 0],
                             [1, 0, 0, 0, 0],
                             [1, 1, 1, 1, 1]]


def test_selective_log_softmax_matches_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, dtype=torch.float64) * 4
    index = torch.randint(0, 17, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, index[..., None]).squeeze(-1)
    assert torch.allclose(g.selective_log_softmax(logits, index).double(), expected, atol=1e-6)


def _toy(seed=0, B=4, C=5):
    torch.manual_seed(seed)
    logps = (-torch.rand(B, C) * 3).requires_grad_()
    old = (logps.detach() + torch.randn(B, C) * 0.3)
    adv = torch.tensor([1.5, -0.5, 0.7, -2.0])[:B]
    mask = torch.ones(B, C, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logps, old, adv, mask


def test_grpo_loss_hand_computed_per_token():
    # one sequence, two tokens, epsilon 0.2: ratio 1.5 with A>0 clips to 1.2; ratio 0.5 with A>0 is not clipped
    logps = torch.log(torch.tensor([[0.3, 0.1]]))
    old = torch.log(torch.tensor([[0.2, 0.2]]))
    mask = torch.ones(1, 2)
    loss, stats = g.grpo_loss(logps, old, torch.tensor([2.0]), mask, epsilon_low=0.2, loss_type="bnpo")
    # per-token: -min(1.5*2, 1.2*2) = -2.4 ; -min(0.5*2, 0.8*2) = -1.0 ; bnpo mean = -1.7
    assert loss.item() == pytest.approx(-1.7, abs=1e-6)
    assert stats["clip_ratio"].item() == pytest.approx(0.5)
    # the same with A<0: -min(-3, -2.4) = 3 ; -min(-1, -1.6) = 1.6 ; mean 2.3; now the low side clips
    loss, stats = g.grpo_loss(logps, old, torch.tensor([-2.0]), mask, epsilon_low=0.2, loss_type="bnpo")
    assert loss.item() == pytest.approx(2.3, abs=1e-6)
    assert stats["clip_ratio"].item() == pytest.approx(0.5)
    # epsilon_high widens only the upper side: ratio 1.5 stays inside [0.8, 1.6]
    loss, _ = g.grpo_loss(logps, old, torch.tensor([2.0]), mask, epsilon_low=0.2, epsilon_high=0.6)
    assert loss.item() == pytest.approx(-(3.0 + 1.0) / 2, abs=1e-6)


def test_k3_kl_hand_computed():
    logps = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    mask = torch.ones(1, 2)
    loss, stats = g.grpo_loss(logps, logps.detach(), torch.tensor([0.0]), mask, beta=0.1,
                              ref_per_token_logps=ref)
    # k3 = exp(ref - logp) - (ref - logp) - 1: token 1 -> 0.5 + ln 2 - 1; token 2 -> 0
    k3 = 0.5 + math.log(2) - 1
    assert stats["kl"].item() == pytest.approx(k3 / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-6)


@pytest.mark.parametrize("loss_type", g.LOSS_TYPES)
def test_loss_type_normalisers_hand_computed(loss_type):
    logps, old, adv, mask = _toy()
    ratio = torch.exp(logps.detach() - old)
    per_tok = -torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]) * mask
    n_tok = mask.sum().item()
    expected = {
        "grpo": sum(per_tok[i].sum() / mask[i].sum() for i in range(4)) / 4,
        "bnpo": per_tok.sum() / n_tok,
        "dr_grpo": per_tok.sum() / (4 * 7),
        "dapo": per_tok.sum() / 30.0,
    }[loss_type]
    loss, _ = g.grpo_loss(logps, old, adv, mask, loss_type=loss_type, max_completion_length=7,
                          num_items_in_batch=30.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_ratio_one_gives_reinforce_gradient():
    """On-policy (old = current, detached) the clipped objective's gradient is REINFORCE's: -A * grad log p."""
    logps, _, adv, mask = _toy()
    loss, _ = g.grpo_loss(logps, logps.detach(), adv, mask, loss_type="bnpo")
    (grad,) = torch.autograd.grad(loss, logps)
    reinforce = -(adv[:, None] * logps * mask).sum() / mask.sum()
    (expected,) = torch.autograd.grad(reinforce, logps)
    assert torch.allclose(grad, expected, atol=1e-7)
    assert grad.abs().sum() > 0


def _accumulated_grad(loss_type, logps, old, adv, mask, splits):
    total_tokens = float(mask.sum())
    grad = torch.zeros_like(logps)
    for idx in splits:
        lp = logps.detach()[idx].clone().requires_grad_()
        loss, _ = g.grpo_loss(lp, old[idx], adv[idx], mask[idx], loss_type=loss_type, max_completion_length=5,
                              num_micro_batches=len(splits), num_items_in_batch=total_tokens)
        loss.backward()
        grad[idx] += lp.grad
    return grad


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_gradient_accumulation_equals_one_big_batch(loss_type):
    logps, old, adv, mask = _toy(B=4)
    big = _accumulated_grad(loss_type, logps, old, adv, mask, [torch.arange(4)])
    acc = _accumulated_grad(loss_type, logps, old, adv, mask, [torch.tensor([0, 1]), torch.tensor([2, 3])])
    if loss_type == "bnpo":
        # the documented exception: micro-batches of 3 + 5 and 1 + 5 tokens weight tokens differently
        assert not torch.allclose(big, acc)
    else:
        assert torch.allclose(big, acc, atol=1e-7)


def test_gradient_accumulation_through_the_model(tiny):
    """The same equivalence with real per-token log-probs of the tiny model (dapo: tokens of the whole step)."""
    model, tok = tiny
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (4, 12))
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # left padding
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[0, 2:] = 0
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])

    def grads(splits):
        model.zero_grad()
        for idx in splits:
            lp = g.per_token_logps(model, ids[idx], attn[idx], 6)
            loss, _ = g.grpo_loss(lp, lp.detach(), adv[idx], mask[idx], loss_type="dapo",
                                  num_micro_batches=len(splits), num_items_in_batch=float(mask.sum()))
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    big = grads([torch.arange(4)])
    acc = grads([torch.tensor([0, 1]), torch.tensor([2, 3])])
    model.zero_grad()
    assert torch.allclose(big, acc, atol=1e-6)
