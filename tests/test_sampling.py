"""Sampling (Part I, 1): the decode loop of generate_completions, sample_next_token's distribution (chi-square, fixed
seeds), positions and masks, every EOS id and one BOS, and a model's own generation defaults kept out."""

import functools

import numpy as np
import pytest
import torch

import grpo_ssr as g
from conftest import scripted_sampler


def _chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is p = 0.001."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


# --- generate_completions: the decode loop ----------------------------------------------------------------------------


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


def test_cached_decode_matches_a_full_forward(tiny, monkeypatch):
    """The logits the loop samples from (prefill once, cache repeated G times, one token per forward) equal the
    logits a full, uncached forward of the finished sequence gives: the KV cache, the positions under left padding
    and the growing mask are right."""
    model, tok = tiny
    calls = _record_sampler(monkeypatch)
    torch.manual_seed(0)
    temperature = 0.9
    prompts = ["a", "TL;DR: a much longer prompt, so the short one is left-padded", "mid length"]
    out = g.generate_completions(model, tok, prompts, 4, 512, 12, temperature=temperature)
    assert out["prompt_ids"].shape[0] == 12 and (out["prompt_mask"][0] == 0).any()  # left padding present
    C = out["completion_ids"].size(1)
    assert len(calls) == C
    sampled = torch.stack([lg for lg, _ in calls], 1)  # (B, C, V): logits at each step
    from_loop = (
        torch.log_softmax(sampled.double() / temperature, -1).gather(-1, out["completion_ids"][..., None]).squeeze(-1)
    )
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
    end_at = torch.tensor([0, 2, 5, 1])  # row r samples EOS at step end_at[r], token 7 before it
    scripted_sampler(monkeypatch, end_at, eos)
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
        assert row[e] == eos and (row[:e] == 7).all() and (row[e + 1 :] == pad).all()
        assert out["completion_mask"][r].tolist() == [1] * (e + 1) + [0] * (5 - e)


def test_generation_without_eos_runs_to_the_limit(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    out = g.generate_completions(model, tok, ["x"], 3, 16, 7)
    assert out["completion_ids"].shape == (3, 7)


def test_sampling_is_the_distribution_the_logps_describe(tiny):
    """First-token counts follow softmax(logits / 0.7) (chi-square, fixed seed): no hidden top-k or top-p."""
    model, tok = tiny
    torch.manual_seed(0)
    n, temperature = 20_000, 0.7
    out = g.generate_completions(model, tok, ["TL;DR:"], n, 64, 1, temperature=temperature)
    counts = np.bincount(out["completion_ids"][:, 0].numpy(), minlength=len(tok))
    ids = tok("TL;DR:", add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1].double()

    def chi2(probs):
        expected = probs.numpy() * n
        return float(((counts - expected) ** 2 / expected).sum())

    critical = _chi2_critical(len(tok) - 1)
    assert chi2(torch.softmax(logits / temperature, -1)) < critical
    assert chi2(torch.softmax(logits, -1)) > critical  # power: temperature 1 is told apart
    assert (counts > 0).sum() > 100  # a top-k of 50 would cap this at 50
    # per_token_logps describes the same distribution
    full = torch.cat([ids, torch.tensor([[int(np.argmax(counts))]])], 1)
    lp = g.per_token_logps(model, full, torch.ones_like(full), 1, temperature=temperature)
    assert lp.exp().item() == pytest.approx(torch.softmax(logits / temperature, -1).max().item(), rel=1e-4)


def _tokenizer_with_bos():
    from tokenizers import processors

    tok = g.build_tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<|bos|>"})
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", tok.bos_token_id)]
    )
    tok.chat_template = "{{ bos_token }}" + tok.chat_template  # as Llama's: the template writes the BOS
    return tok


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_prompts_start_with_exactly_one_bos(cfg_factory, chat):
    tok = _tokenizer_with_bos()
    assert tok("ab").input_ids[0] == tok.bos_token_id  # the tokenizer adds a BOS by default
    torch.manual_seed(0)
    model = g.build_tiny_model(len(tok))
    rows = [{"prompt": [{"role": "user", "content": f"hi {i}"}] if chat else f"post {i}: TL;DR:"} for i in range(4)]
    trainer = g.GRPOTrainer(cfg_factory(), model=model, processing_class=tok, train_dataset=rows)
    for s in trainer.generate_batch():
        prompt = s["prompt_ids"][s["prompt_mask"].bool()].tolist()
        assert prompt[0] == tok.bos_token_id and prompt.count(tok.bos_token_id) == 1, prompt


# --- sample_next_token ------------------------------------------------------------------------------------------------


def test_sample_next_token_follows_softmax_over_temperature():
    """40k draws per row from hand-made logits: chi-square at p = 0.001, -inf tokens never drawn, and power."""
    torch.manual_seed(0)
    logits = torch.tensor(
        [
            [2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [5.0, -3.0, 1.0, 1.0, 2.0, float("-inf")],
        ]
    )
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
            assert float(((counts[live] - n * wrong[live]) ** 2 / (n * wrong[live])).sum()) > _chi2_critical(
                int(live.sum()) - 1
            )


def test_sample_next_token_is_seeded_and_thread_invariant():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    runs, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.manual_seed(5)
            runs.append(torch.stack([g.sample_next_token(logits, 1.0) for _ in range(50)]))
    finally:
        torch.set_num_threads(before)  # the tests after this one keep the thread count they were given
    assert torch.equal(runs[0], runs[1])


# --- the completion mask, EOS ids and the model's generation config ---------------------------------------------------


def test_completion_mask_from_eos():
    eos = 9
    ids = torch.tensor([[1, 2, 9, 4, 9], [9, 1, 1, 1, 1], [1, 2, 3, 4, 5]])
    mask = g.completion_mask_from_eos(ids, eos)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_hub_generation_defaults_do_not_leak_into_sampling(tmp_path):
    """A model saved with greedy-ish defaults (top_k=1) still samples from the full distribution after load_model."""
    torch.manual_seed(0)
    tok = g.build_tiny_tokenizer()
    model = g.build_tiny_model(len(tok))
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(do_sample=True, top_k=1, repetition_penalty=5.0)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, ltok = g.load_model(str(tmp_path / "m"))
    out = g.generate_completions(loaded, ltok, ["abc"], 64, 16, 1)
    assert out["completion_ids"][:, 0].unique().numel() > 20


def test_every_eos_id_ends_a_completion_and_is_kept_in_the_saved_config(tiny, monkeypatch, tmp_path):
    model, tok = tiny
    model = g.copy.deepcopy(model)
    im_end = 65  # a second end-of-turn id, as Qwen2-Instruct's <|im_end|> beside <|endoftext|>
    model.generation_config.eos_token_id = [im_end, tok.eos_token_id]
    g.reset_generation_config(model, tok)
    assert g.eos_token_ids(model, tok) == [tok.eos_token_id, im_end]
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, ltok = g.load_model(str(tmp_path / "m"))
    assert sorted(g.eos_token_ids(loaded, ltok)) == sorted([tok.eos_token_id, im_end])
    # rows end at steps 1, 3 (the second id) and 2 (the tokenizer's); the last never ends
    scripted_sampler(monkeypatch, [1, 3, 2, 99], [im_end, im_end, tok.eos_token_id, im_end])
    out = g.generate_completions(model, tok, ["x"], 4, 16, 8)
    assert out["completion_mask"].sum(1).tolist() == [2, 4, 3, 8]
    assert (out["completion_ids"][0, 2:] == tok.pad_token_id).all()
    assert g.completion_mask_from_eos(torch.tensor([[1, im_end, 2, 3]]), [tok.eos_token_id, im_end]).tolist() == [
        [1, 1, 0, 0]
    ]
