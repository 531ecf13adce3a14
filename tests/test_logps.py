"""The memory-lean log-prob path (hidden states -> head in chunks, recomputed in backward) equals the plain full-logits
one, and holds one chunk of logits at its peak."""
from pathlib import Path

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


def test_lean_path_is_taken_when_the_probe_agrees_and_the_fallback_gives_plain_values(monkeypatch):
    """The decision is measured: a config name the model never reads (Qwen2 has no soft-capping) does not turn the
    lean path off. Models that do post-process their logits: tests/test_trl_alignment.py."""
    tok = g.build_tiny_tokenizer()
    model = g.build_tiny_model(len(tok))
    model.config.final_logit_softcapping = 30.0
    assert g._lean_head(model) is model.lm_head
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 9))
    attn = torch.ones_like(ids)
    monkeypatch.setattr(g, "_lean_head", lambda model: None)  # the fallback still gives the plain values
    assert torch.allclose(g.per_token_logps(model, ids, attn, 4), _plain(model, ids, attn, 4, 1.0), atol=1e-5)


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
            rows.extend(t.numel() // V for t in tree_flatten(out)[0]
                        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.size(-1) == V
                        and t.untyped_storage().data_ptr() not in weights)
            return out

    ids = torch.randint(0, 256, (4, 12))
    assert g._lean_head(model) is model.lm_head  # the once-per-model probe (8 tokens of logits) runs here, before
    with VocabSized():
        lp = g.per_token_logps(model, ids, torch.ones_like(ids), 10, chunk_size=4)
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
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(ROOT), path], capture_output=True, text=True,
                             timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.split()[-1])

    lean, plain = chunks("lean"), chunks("plain")
    assert lean < 1.5, lean
    assert plain > 2.5, plain  # the measurement can tell the two apart
