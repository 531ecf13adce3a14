"""The decode loop of generate_completions: the sampler's distribution, the KV cache against a full forward, the
shared prompt prefill, and the early stop."""
import functools

import numpy as np
import pytest
import torch

import grpo_ssr as g
from test_training import _chi2_critical


def test_sample_next_token_follows_softmax_over_temperature():
    """40k draws per row from hand-made logits: chi-square at p = 0.001, -inf tokens never drawn, and power."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [5.0, -3.0, 1.0, 1.0, 2.0, float("-inf")]])
    n, temperature = 40_000, 0.7
    draws = torch.stack([g.sample_next_token(logits, temperature) for _ in range(n)])  # (n, 3)
    for row in range(3):
        counts = np.bincount(draws[:, row].numpy(), minlength=6)
        probs = torch.softmax(logits[row].double() / temperature, -1).numpy()
        assert counts[probs == 0].sum() == 0  # a masked token is never drawn
        live = probs > 0
        chi2 = float(((counts[live] - n * probs[live]) ** 2 / (n * probs[live])).sum())
        assert chi2 < _chi2_critical(int(live.sum()) - 1)
        if row != 1:  # the uniform row is the same at every temperature
            wrong = torch.softmax(logits[row].double(), -1).numpy()  # temperature 1: must be told apart
            assert float(((counts[live] - n * wrong[live]) ** 2 / (n * wrong[live])).sum()) > \
                _chi2_critical(int(live.sum()) - 1)


def test_sample_next_token_is_seeded_and_thread_invariant():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        torch.manual_seed(5)
        runs.append(torch.stack([g.sample_next_token(logits, 1.0) for _ in range(50)]))
    assert torch.equal(runs[0], runs[1])


def _record_sampler(monkeypatch):
    """Wrap sample_next_token so that every call's logits and drawn tokens are kept."""
    calls = []
    real = g.sample_next_token

    def recording(logits, temperature=1.0):
        token = real(logits, temperature)
        calls.append((logits.clone(), token.clone()))
        return token

    monkeypatch.setattr(g, "sample_next_token", recording)
    return calls


@pytest.mark.parametrize("shared_prefill", [True, False], ids=["shared-prefill", "prefill-every-row"])
def test_cached_decode_matches_a_full_forward(tiny, monkeypatch, shared_prefill):
    """The logits the loop samples from (prefill once, cache repeated G times, one token per forward) equal the
    logits a full, uncached forward of the finished sequence gives: the KV cache, the positions under left padding
    and the growing mask are right. Without batch_repeat_interleave the loop must prefill every row instead."""
    model, tok = tiny
    if not shared_prefill:
        from transformers.cache_utils import Cache

        monkeypatch.setattr(Cache, "batch_repeat_interleave", None)  # as if the cache type had no such method
    calls = _record_sampler(monkeypatch)
    torch.manual_seed(0)
    temperature = 0.9
    prompts = ["a", "TL;DR: a much longer prompt, so the short one is left-padded", "mid length"]
    out = g.generate_completions(model, tok, prompts, 4, 512, 12, temperature=temperature)
    assert out["prompt_ids"].shape[0] == 12 and (out["prompt_mask"][0] == 0).any()  # left padding present
    C = out["completion_ids"].size(1)
    assert len(calls) == C
    sampled = torch.stack([lg for lg, _ in calls], 1)  # (B, C, V): logits at each step
    from_loop = torch.log_softmax(sampled.double() / temperature, -1).gather(
        -1, out["completion_ids"][..., None]).squeeze(-1)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    full_mask = torch.cat([out["prompt_mask"], torch.ones_like(out["completion_ids"])], 1)  # as the loop saw it
    with torch.no_grad():
        from_forward = g.per_token_logps(model, ids, full_mask, C, temperature=temperature)
    assert torch.allclose(from_loop.float(), from_forward, atol=1e-5)
    # each group's first token came from one shared logits row
    first = sampled[:, 0].view(3, 4, -1)
    assert torch.equal(first, first[:, :1].expand_as(first))


def test_generation_stops_when_every_row_has_ended(tiny, monkeypatch):
    """Rows end at different steps; ended rows get pad; the loop stops at the last EOS and runs no extra forward."""
    model, tok = tiny
    eos, pad = tok.eos_token_id, tok.pad_token_id
    end_at = torch.tensor([0, 2, 5, 1])  # row r samples EOS at step end_at[r]
    step = {"n": 0}

    def scripted(logits, temperature=1.0):
        t = step["n"]
        step["n"] += 1
        return torch.where(end_at == t, eos, 7)

    monkeypatch.setattr(g, "sample_next_token", scripted)
    forwards = {"n": 0}
    real_forward = model.forward

    @functools.wraps(real_forward)  # keeps the signature, which tells the loop the cache argument's name
    def counting_forward(*a, **kw):
        forwards["n"] += 1
        return real_forward(*a, **kw)

    monkeypatch.setattr(model, "forward", counting_forward)
    out = g.generate_completions(model, tok, ["x", "y"], 2, 16, 64)
    assert out["completion_ids"].size(1) == 6  # stopped at the last EOS, not at 64
    assert forwards["n"] == 1 + 5  # one prefill, then one forward per token that still had to be sampled
    for r, e in enumerate(end_at.tolist()):
        row = out["completion_ids"][r]
        assert row[e] == eos and (row[:e] == 7).all() and (row[e + 1:] == pad).all()
        assert out["completion_mask"][r].tolist() == [1] * (e + 1) + [0] * (5 - e)


def test_generation_without_eos_runs_to_the_limit(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    out = g.generate_completions(model, tok, ["x"], 3, 16, 7)
    assert out["completion_ids"].shape == (3, 7)
