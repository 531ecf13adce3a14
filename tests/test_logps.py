"""The memory-lean log-prob path (hidden states -> head in checkpointed chunks) equals the plain full-logits one."""
import pytest
import torch

import grpo_ssr as g


def _plain(model, ids, attn, keep, temperature):
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -keep - 1:-1]  # (B, C, V)
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[:, -keep:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
def test_chunked_logps_and_grads_equal_full_logits(chunk_size):
    torch.manual_seed(0)
    tok = g.build_tiny_tokenizer(extra_tokens=500)  # a larger vocabulary than the default
    model = g.build_tiny_model(len(tok)).float()
    ids = torch.randint(0, len(tok), (3, 15))
    attn = torch.ones_like(ids)
    attn[0, :4] = 0
    keep, temperature = 6, 0.8

    lean = g.per_token_logps(model, ids, attn, keep, temperature, chunk_size=chunk_size)
    weights = torch.randn_like(lean)
    (lean * weights).sum().backward()
    lean_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    plain = _plain(model, ids, attn, keep, temperature)
    (plain * weights).sum().backward()
    assert torch.allclose(lean, plain, atol=1e-5)
    for a, b in zip(lean_grads, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, atol=1e-5)


def test_lean_path_is_taken_and_softcapped_models_fall_back():
    tok = g.build_tiny_tokenizer()
    model = g.build_tiny_model(len(tok))
    assert g._lean_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0
    assert g._lean_head(model) is None
    # the fallback still gives the plain values
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 9))
    attn = torch.ones_like(ids)
    assert torch.allclose(g.per_token_logps(model, ids, attn, 4), _plain(model, ids, attn, 4, 1.0), atol=1e-5)


def test_lean_path_never_builds_full_logits(monkeypatch):
    """With chunk_size 4, no (rows, V) logits tensor of more than 4 rows is ever made by the head."""
    torch.manual_seed(0)
    tok = g.build_tiny_tokenizer()
    model = g.build_tiny_model(len(tok))
    shapes = []
    real = g._head_logps

    def spy(hidden, *args):
        shapes.append(hidden.shape[0])
        return real(hidden, *args)

    monkeypatch.setattr(g, "_head_logps", spy)
    ids = torch.randint(0, 256, (4, 12))
    lp = g.per_token_logps(model, ids, torch.ones_like(ids), 10, chunk_size=4)
    lp.sum().backward()
    assert lp.shape == (4, 10) and max(shapes) == 4 and sum(shapes) >= 40
