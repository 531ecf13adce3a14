"""Log-probabilities and the loss (Part I, 5-6, and Part II's memory-lean path): per_token_logps against the full
logits, grpo_loss by hand for every loss_type, the k3 KL and its bias correction, gradient accumulation against one
big batch, and the lean path (values, gradients, memory, and the probe that turns it off)."""

import math
from pathlib import Path

import pytest
import torch

import grpo_ssr as g
from conftest import scripted_sampler


def _full_logits_logps(model, ids, attn, keep, temperature):
    """The plain way, to compare with: the model's full logits, log-softmax, gather (gradients flow)."""
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, -keep - 1 : -1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[:, -keep:, None]).squeeze(-1)  # (B, C)


# --- per_token_logps --------------------------------------------------------------------------------------------------


def test_full_logits_path_upcasts_bf16_before_the_temperature():
    tok = g.build_tiny_tokenizer()
    torch.manual_seed(0)
    model = g.build_tiny_model(len(tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(200)  # logits in the tens, where bf16 rounding of logits / T shows
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=g.positions_from_mask(attn)).logits
        got = g.per_token_logps(model, ids, attn, 5, temperature=0.7)
    expected = torch.log_softmax(logits[:, -6:-1].float() / 0.7, -1).gather(-1, ids[:, -5:, None]).squeeze(-1)
    assert torch.allclose(got, expected, atol=1e-5)


def test_selective_log_softmax_matches_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, dtype=torch.float64) * 4
    index = torch.randint(0, 17, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, index[..., None]).squeeze(-1)
    assert torch.allclose(g.selective_log_softmax(logits, index).double(), expected, atol=1e-6)


# --- grpo_loss: the clipped surrogate and its normalisations ----------------------------------------------------------


def _toy(seed=0, B=4, C=5):
    torch.manual_seed(seed)
    logps = (-torch.rand(B, C) * 3).requires_grad_()
    old = logps.detach() + torch.randn(B, C) * 0.3
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
    loss, _ = g.grpo_loss(logps, old, adv, mask, loss_type=loss_type, max_completion_length=7, num_items_in_batch=30.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_default_loss_type_is_dapo():
    assert g.GRPOConfig().loss_type == "dapo"
    logps = torch.log(torch.tensor([[0.3, 0.1, 0.2]]))
    mask = torch.tensor([[1, 1, 0]])
    default, _ = g.grpo_loss(logps, logps, torch.tensor([1.0]), mask)
    dapo, _ = g.grpo_loss(logps, logps, torch.tensor([1.0]), mask, loss_type="dapo", num_items_in_batch=2.0)
    assert default.item() == dapo.item() == pytest.approx(-1.0)


def test_ratio_one_gives_reinforce_gradient():
    """On-policy (old = current, detached) the clipped objective's gradient is REINFORCE's: -A * grad log p."""
    logps, _, adv, mask = _toy()
    loss, _ = g.grpo_loss(logps, logps.detach(), adv, mask, loss_type="bnpo")
    (grad,) = torch.autograd.grad(loss, logps)
    reinforce = -(adv[:, None] * logps * mask).sum() / mask.sum()
    (expected,) = torch.autograd.grad(reinforce, logps)
    assert torch.allclose(grad, expected, atol=1e-7)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("loss_type", g.LOSS_TYPES)
@pytest.mark.parametrize("bias_correction", [True, False])
def test_extreme_logps_at_padded_slots_change_nothing(loss_type, bias_correction):
    torch.manual_seed(0)
    logps = -torch.rand(3, 5) * 3
    old = logps + torch.randn(3, 5) * 0.2
    ref = logps + torch.randn(3, 5) * 0.3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    pad = ~mask.bool()
    kw = dict(beta=0.1, loss_type=loss_type, max_completion_length=5, use_bias_correction_kl=bias_correction)

    def loss_and_grad(lp, o, r):
        lp = lp.clone().requires_grad_()
        loss, stats = g.grpo_loss(lp, o, torch.tensor([1.0, -0.5, 2.0]), mask, ref_logps=r, **kw)
        loss.backward()
        return loss, lp.grad, stats

    clean = loss_and_grad(logps, old, ref)
    # -1000 is what a policy gives the pad token at a low temperature; repad stores 0 for ref and old there
    planted = loss_and_grad(logps.masked_fill(pad, -1000.0), old.masked_fill(pad, 0.0), ref.masked_fill(pad, 0.0))
    assert torch.isfinite(planted[0]) and torch.isfinite(planted[1]).all()
    assert planted[0].item() == pytest.approx(clean[0].item(), rel=1e-6)
    assert torch.allclose(planted[1], clean[1]) and (planted[1][pad] == 0).all()
    assert planted[2]["kl"].item() == pytest.approx(clean[2]["kl"].item(), rel=1e-6)


def test_beta_training_steps_stay_finite_with_extreme_padded_logps(cfg_factory, monkeypatch):
    """The real train_step with beta > 0: completions of unequal length (scripted EOS), and a policy whose log-prob
    at every padded slot is -1000 (as a low temperature gives the pad token). No step may become non-finite."""
    trainer = g.GRPOTrainer(cfg_factory(beta=0.1, max_steps=3, temperature=0.5))
    scripted_sampler(monkeypatch, [2, 5, 9, 15], trainer.tokenizer.eos_token_id)
    real, planted_calls = trainer.logps_fn, []

    def planted(model, input_ids, attention_mask, logits_to_keep, *a, **kw):  # the trainer's log-probs (lean_logps)
        planted_calls.append(1)
        lp = real(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        return lp.masked_fill(attention_mask[:, -logits_to_keep:] == 0, -1000.0)

    trainer.logps_fn = planted
    for _ in range(3):
        m = trainer.train_step()
        assert math.isfinite(m["loss"]) and math.isfinite(m["kl"]) and m["skipped"] == 0, m
    assert trainer.counters["nonfinite_steps"] == 0
    assert planted_calls  # the planted log-probs are the ones the steps trained with


# --- the k3 KL penalty and its bias correction ------------------------------------------------------------------------


def test_k3_kl_hand_computed():
    logps = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    mask = torch.ones(1, 2)
    loss, stats = g.grpo_loss(logps, logps.detach(), torch.tensor([0.0]), mask, beta=0.1, ref_logps=ref)
    # k3 = exp(ref - logp) - (ref - logp) - 1: token 1 -> 0.5 + ln 2 - 1; token 2 -> 0
    k3 = 0.5 + math.log(2) - 1
    assert stats["kl"].item() == pytest.approx(k3 / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-6)


def test_bias_correction_multiplies_k3_by_the_ratio_hand_computed():
    logps = torch.log(torch.tensor([[0.5, 0.25]]))
    old = torch.log(torch.tensor([[0.25, 0.25]]))  # ratios 2 and 1
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2)
    k3 = [0.5 + math.log(2) - 1, 2 - math.log(2) - 1]
    kw = dict(beta=0.1, ref_logps=ref, loss_type="bnpo", epsilon_low=10.0)
    with_ratio, stats = g.grpo_loss(logps, old, torch.tensor([0.0]), mask, use_bias_correction_kl=True, **kw)
    assert with_ratio.item() == pytest.approx(0.1 * (2 * k3[0] + k3[1]) / 2, rel=1e-6)
    plain, _ = g.grpo_loss(logps, old, torch.tensor([0.0]), mask, use_bias_correction_kl=False, **kw)
    assert plain.item() == pytest.approx(0.1 * (k3[0] + k3[1]) / 2, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(sum(k3) / 2, rel=1e-6)  # the logged KL is plain k3


def _expected_kl_gradient(use_bias_correction_kl: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact expectation, over tokens y ~ pi, of the gradient of the per-token KL term at pi = pi_old (one
    token position, a 5-token vocabulary), and the gradients of the true reverse and forward KL."""
    theta = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 1.0, 0.5, -0.5, 2.0], dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    p = logp.exp().detach()
    total = 0.0
    for y in range(5):  # the expectation, exactly: sum over y of pi(y) * per-token loss of sampling y
        lp = logp[y].view(1, 1)
        loss, _ = g.grpo_loss(
            lp,
            lp.detach(),
            torch.zeros(1),
            torch.ones(1, 1),
            beta=1.0,
            ref_logps=ref[y].view(1, 1),
            loss_type="bnpo",
            use_bias_correction_kl=use_bias_correction_kl,
        )
        total = total + p[y] * loss
    (grad,) = torch.autograd.grad(total, theta)
    logp = torch.log_softmax(theta, -1)
    reverse = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)[0]  # KL(pi || ref)
    forward = torch.autograd.grad((ref.exp() * (ref - torch.log_softmax(theta, -1))).sum(), theta)[0]  # KL(ref || pi)
    return grad, reverse, forward


def test_bias_corrected_k3_gives_the_reverse_kl_gradient_plain_k3_the_forward():
    grad, reverse, forward = _expected_kl_gradient(True)
    assert torch.allclose(grad, reverse, atol=1e-12) and not torch.allclose(grad, forward, atol=1e-3)
    grad, reverse, forward = _expected_kl_gradient(False)
    assert torch.allclose(grad, forward, atol=1e-12) and not torch.allclose(grad, reverse, atol=1e-3)


def test_bias_correction_is_a_config_field_passed_to_the_loss(cfg_factory, monkeypatch):
    names = [f.name for f in g.dataclasses.fields(g.GRPOConfig)]
    assert names[names.index("beta") + 1] == "use_bias_correction_kl"  # beside beta, among the algorithm's settings
    assert "use_bias_correction_kl" in {f.name for f in g.dataclasses.fields(g.AlgorithmConfig)}
    assert g.GRPOConfig().use_bias_correction_kl is True
    assert g.parse_cli(["--use_bias_correction_kl", "false"])[0].use_bias_correction_kl is False
    seen = []
    real = g.grpo_loss
    monkeypatch.setattr(g, "grpo_loss", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    for value in (True, False):
        g.GRPOTrainer(cfg_factory(beta=0.1, use_bias_correction_kl=value)).train_step()
        assert seen[-1]["use_bias_correction_kl"] is value and seen[-1]["loss_type"] == "dapo"


def test_beta_logs_kl_and_uses_a_frozen_reference(cfg_factory):
    trainer = g.GRPOTrainer(cfg_factory(beta=0.1, max_steps=2))
    m1, m2 = trainer.train_step(), trainer.train_step()
    assert m1["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy equals the reference before any update
    assert m2["kl"] > 0
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())


# --- gradient accumulation gives the gradient of one big batch --------------------------------------------------------


def _accumulated_grad(loss_type, logps, old, adv, mask, splits):
    total_tokens = float(mask.sum())
    grad = torch.zeros_like(logps)
    for idx in splits:
        lp = logps.detach()[idx].clone().requires_grad_()
        loss, _ = g.grpo_loss(
            lp,
            old[idx],
            adv[idx],
            mask[idx],
            loss_type=loss_type,
            max_completion_length=5,
            num_micro_batches=len(splits),
            num_items_in_batch=total_tokens,
        )
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
            loss, _ = g.grpo_loss(
                lp,
                lp.detach(),
                adv[idx],
                mask[idx],
                loss_type="dapo",
                num_micro_batches=len(splits),
                num_items_in_batch=float(mask.sum()),
            )
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    big = grads([torch.arange(4)])
    acc = grads([torch.tensor([0, 1]), torch.tensor([2, 3])])
    model.zero_grad()
    assert torch.allclose(big, acc, atol=1e-6)


# --- the memory-lean path: the head a chunk of tokens at a time (Part II) ---------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
def test_chunked_logps_and_grads_equal_full_logits(chunk_size):
    torch.manual_seed(0)
    tok = g.build_tiny_tokenizer(extra_tokens=500)  # a larger vocabulary than the default
    model = g.build_tiny_model(len(tok)).float()
    ids = torch.randint(0, len(tok), (3, 15))
    attn = torch.ones_like(ids)
    attn[0, :4] = 0
    keep, temperature = 6, 0.8

    assert g.lean_head(model) is model.lm_head  # the lean path is the one measured here
    lean = g.lean_logps(model, ids, attn, keep, temperature, chunk_size=chunk_size)
    weights = torch.randn_like(lean)
    (lean * weights).sum().backward()
    lean_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    plain = _full_logits_logps(model, ids, attn, keep, temperature)
    (plain * weights).sum().backward()
    assert torch.allclose(lean, plain, atol=1e-5)
    for a, b in zip(lean_grads, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, atol=1e-5)


def test_head_logprobs_backward_replays_cpu_autocast():
    """Under CPU bf16 autocast, backward must rebuild the bf16 logits the forward normalised: then d logp / d bias
    = onehot - p sums to 0 over the vocabulary. Rebuilding them in float32 leaves a visible error."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 300)
    head.weight.data *= 8  # logits of a few tens, where bf16 rounding shows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = g.chunked_head_logps(torch.randn(1, 1, 64), head, torch.tensor([[5]]), 1.0, 16)
    lp.sum().backward()
    assert abs(float(head.bias.grad.sum())) < 1e-5


def test_lean_path_never_builds_full_logits():
    """With chunk_size 4, no tensor of more than 4 rows of V logits is made, in forward or in backward: every aten
    op's output is inspected."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    torch.manual_seed(0)
    tok = g.build_tiny_tokenizer()
    model = g.build_tiny_model(len(tok))
    V, rows = len(tok), []
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # (H, V) views of the head: not logits

    class VocabSized(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            rows.extend(
                t.numel() // V
                for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor)
                and t.dim() >= 2
                and t.size(-1) == V
                and t.untyped_storage().data_ptr() not in weights
            )
            return out

    ids = torch.randint(0, 256, (4, 12))
    assert g.lean_head(model) is model.lm_head  # the once-per-model probe (8 tokens of logits) runs here, before
    with VocabSized():
        lp = g.lean_logps(model, ids, torch.ones_like(ids), 10, chunk_size=4)
        lp.sum().backward()
    assert lp.shape == (4, 10) and len(rows) > 10 and max(rows) == 4


# The peak is read from /proc/self/status (VmHWM), which belongs to this process's own memory map. getrusage's
# ru_maxrss would not do: Linux carries the parent's high-water mark into a child across fork and exec, so under a
# pytest process that has grown past 1 GB the child's ru_maxrss starts above the peak being measured.
PEAK_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import grpo_ssr as g

def status_bytes(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

torch.manual_seed(0)
N, V, H = 2048, 50_000, 16
head = torch.nn.Linear(H, V, bias=True)
hidden = torch.randn(N, H, requires_grad=True)
targets = torch.randint(0, V, (N,))
try:
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current VmRSS (the imports' peak is not ours)
except OSError:
    pass
before = status_bytes("VmRSS")
if sys.argv[2] == "lean":
    lp = g.chunked_head_logps(hidden, head, targets, 0.8, chunk_size=N)
else:
    lp = torch.log_softmax(head(hidden) / 0.8, -1).gather(-1, targets[:, None])
lp.sum().backward()
grown = status_bytes("VmHWM") - before
print(grown / (N * V * 4))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc/self/status")
def test_one_chunk_of_logits_at_its_peak():
    """The resident-memory high-water mark of forward + backward over one 2048 x 50,000 chunk (410 MB of fp32
    logits), each in a fresh process: about one chunk for HeadLogProbs, several for plain autograd. Buffers this size
    are mmap-ed, so the kernel's high-water mark (VmHWM) sees every one that is alive at the same time."""
    import subprocess
    import sys

    from conftest import ROOT

    def chunks(path):
        out = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, str(ROOT), path],
            capture_output=True,
            text=True,
            timeout=300,
            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.split()[-1])

    lean, plain = chunks("lean"), chunks("plain")
    assert lean < 1.5, lean
    assert plain > 2.5, plain  # the measurement can tell the two apart


def test_lean_path_is_taken_when_the_probe_agrees_and_the_fallback_gives_plain_values(monkeypatch):
    """The decision is measured: a config name the model never reads (Qwen2 has no soft-capping) does not turn the
    lean path off. Models that do post-process their logits: the next test."""
    tok = g.build_tiny_tokenizer()
    model = g.build_tiny_model(len(tok))
    model.config.final_logit_softcapping = 30.0
    assert g.lean_head(model) is model.lm_head
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 9))
    attn = torch.ones_like(ids)
    monkeypatch.setattr(g, "lean_head", lambda model: None)  # the fallback still gives the plain values
    assert torch.allclose(g.lean_logps(model, ids, attn, 4), _full_logits_logps(model, ids, attn, 4, 1.0), atol=1e-5)


def _falcon_h1(multiplier):
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(0)
    return FalconH1ForCausalLM(
        FalconH1Config(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            mamba_d_ssm=64,
            mamba_n_heads=8,
            mamba_d_head=8,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            lm_head_multiplier=multiplier,
        )
    )


def _recurrent_gemma(cap):
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    torch.manual_seed(0)
    return RecurrentGemmaForCausalLM(
        RecurrentGemmaConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            lru_width=64,
            attention_window_size=16,
            head_dim=16,
            logits_soft_cap=cap,
        )
    )


@pytest.mark.parametrize(
    "build,post,neutral",
    [(_falcon_h1, 5.0, 1.0), (_recurrent_gemma, 30.0, 1e6)],
    ids=["falcon_h1-lm_head_multiplier", "recurrent_gemma-logits_soft_cap"],
)
def test_models_that_post_process_logits_take_the_full_path(build, post, neutral, monkeypatch):
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0
    model = build(post)
    # the mismatch is real: the head alone gives other log-probs than the model's own logits
    head_only = g.chunked_head_logps(
        model.model(
            input_ids=ids, attention_mask=attn, position_ids=g.positions_from_mask(attn), use_cache=False
        ).last_hidden_state[:, -5:-1],
        model.lm_head,
        ids[:, -4:],
        0.7,
        512,
    ).detach()
    full = _full_logits_logps(model, ids, attn, 4, 0.7)
    assert (head_only - full).abs().max() > 1e-3
    # ... and the probe catches it: lean_logps equals the full-logits path
    calls, real_forward = [], model.forward  # the shapes of the full forwards: the probe's is (1, 8)
    monkeypatch.setattr(model, "forward", lambda **kw: calls.append(tuple(kw["input_ids"].shape)) or real_forward(**kw))
    assert g.lean_head(model) is None
    for _ in range(2):
        assert torch.allclose(g.lean_logps(model, ids, attn, 4, 0.7).detach(), full, atol=1e-5)
    assert calls == [(1, 8), (2, 10), (2, 10)]  # probed once per model, then the full path
    # the same architecture without post-processing keeps the lean path
    plain = build(neutral)
    assert g.lean_head(plain) is plain.lm_head
    assert torch.allclose(
        g.lean_logps(plain, ids, attn, 4, 0.7).detach(), _full_logits_logps(plain, ids, attn, 4, 0.7), atol=1e-5
    )
