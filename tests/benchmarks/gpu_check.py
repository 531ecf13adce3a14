"""GPU check: grpo_ssr on one CUDA device, measured, and checked so that it cannot pass by doing nothing.

    python tests/benchmarks/gpu_check.py                       # on a GPU machine: about 4 minutes on one H200
    python tests/benchmarks/gpu_check.py --device cpu --small  # the lines a CPU can run, on a small model (~40 s)

Output: one line per named check, `NAME: pass {what it measured, as JSON}`, `NAME: fail: why` or `NAME: needs
CUDA`; then one JSON line with the measurements; then a README-ready Markdown row. Exit status: 0 when no check
failed; 1 when one did, with one more line on stderr naming each; 2 when it could not start, with one line on
stderr: with the default --device cuda that is a machine where torch sees no CUDA device (a CPU-only torch on a GPU
machine fails here, it does not pass).

Nothing is downloaded. The benchmark model is Qwen2ForCausalLM built in code from Qwen2-0.5B-Instruct's
configuration (hidden 896, MLP 4864, 24 layers, 14 attention heads, 2 key/value heads, vocabulary 151,936, tied
embeddings, rope theta 1e6; checked against the published config.json) with random weights; the tokenizer is
grpo_ssr.build_tiny_tokenizer padded with dummy tokens to the same vocabulary. A random model over 152k tokens
almost never samples EOS, so its completions run to max_completion_length: a fixed, known amount of work. --small
swaps in 2 layers, hidden 64 and a vocabulary of 8,192. "tiny" is grpo_ssr.load_model("tiny") (vocabulary 258:
a random model of it samples EOS about once in 258 tokens, so some completions stop early).

Every run goes through GRPOTrainer(cfg, model=..., processing_class=...).train() in a temporary folder, as a user's
would. The runs: `ssr` (the benchmark: Qwen shape, SSR fill, 16 completions a step, 8 per prompt, 256 new tokens,
32 with --small, learning rate 1e-6, 6 steps, 4 with --small); `resume_ref` and `resumed` (Qwen shape, 4 steps at
learning rate 1e-4 with a checkpoint at step 2, then a fresh trainer resumes it); `bf16` (tiny, passed in bf16);
`branches` (tiny, beta 0.04, SSR replace, num_iterations 2, gradient_accumulation_steps 2, held-out evaluation
every 3 of 6 steps) and `dynamic` (tiny, dynamic_sampling, gradient_accumulation_steps 2, 3 steps). The named checks:

- benchmark: the ssr run made its steps and the timers saw them (generation calls after --warmup, a step_time).
- precision: what ran is what the device calls for: "bf16 autocast" exactly when CUDA and
  torch.cuda.get_device_capability() >= (8, 0) (native bf16, as grpo_ssr.pick_device decides), else "float32".
  Each run's grpo_config.json must say so, and the output dtype of the model's first Linear layer, recorded by a
  hook in every forward of every run (generation and training), must be bfloat16 resp. float32 and nothing else.
- memory (CUDA): the ssr run's peak allocated memory, the statistics reset after the trainer put the model on the
  device, must be at least the float32 weights' bytes (so above 0) and at most the bound `memory_bound` derives:
  1.25 x (26 B a parameter: the float32 weights, gradients and AdamW's two moments (16), AdamW's foreach
  temporaries, torch's default on CUDA (8), autocast's bf16 copies of the weights (2); the activations autograd
  saves, measured on the device by a probe forward of the body (the bytes saved for backward per token at two
  lengths, so that the weights cancel) x the tokens of the largest micro-batch, 16 x (longest prompt 146 +
  max_completion_length), and two layers' worth more for backward's transients; the lean head's (chunk, vocabulary)
  buffers, 24 B an entry; generation's KV cache and sampling's three float64 (B, V)) + 1 GiB (cuBLAS workspaces,
  the allocator's rounding). The probe, run on a CPU on 2 layers of the Qwen shape (2026-12-05), saw 73.5 kB a
  token a layer under bf16 autocast (118 kB in float32); with that the Qwen shape's bound is about 33 GiB, of
  which 11.5 are activations and 12 the weights and optimizer state, and 7 GiB of slack. A second copy of the
  model with its optimizer state (12 GiB), or a step's activations kept into the next, breaks it; a fall-back to
  full logits (16 x 256 x 151,936 entries, 2.5 GB a float32 copy, three or four copies under autograd) lands near
  it, and the lean_logps check catches that one by name.
- steps: in every run, every step has a finite loss and a finite gradient norm > 0, none is skipped, and the
  counters nonfinite_steps and skipped_steps stay 0. A run that raised fails here too.
- weights_move: in every run that starts from initial weights, at least half of the elements of the 2-D weights
  changed (a copy is taken on the CPU before the trainer is built; elements, not tensors, because in a tensor
  that cannot move the few weights near 0 still do). Measured on the tiny model: 99.9%. A no-op optimizer: 0%.
- bf16_model: the tiny model `.to(torch.bfloat16)`, passed in: after the trainer is built every parameter is
  float32 (grpo_ssr keeps float32 master weights), AdamW's exp_avg and exp_avg_sq are float32, and after 3 steps at
  learning rate 1e-6 at least half of the 2-D weights' elements moved. Were the weights left bf16, an update of
  ~1e-6 on weights of ~0.02 would round away (bf16 keeps 8 bits: its step there is ~1e-4). Measured on a CPU:
  99.9% moved; with grpo_ssr's conversion undone (Module.float a no-op), bf16 parameters and moments and 2.0%.
- parity_sampled: 16 completions (2 prompts x 8) sampled by grpo_ssr.generate_completions at temperature 0.7 from
  the trained ssr model; each sampled token's log-prob, log_softmax(logits / T) of the decode loop's logits (a
  wrapper of grpo_ssr.sample_next_token records them), against grpo_ssr.lean_logps on the finished batch, both in
  the run's precision. Tolerance on the largest |difference| over the kept tokens: 1e-3 in float32 (the KV-cache
  path and the full forward compute the same sums in another order), with the mean under 1e-3; 0.3 under bf16
  autocast, with the mean |difference| under 0.03 (the decode loop's GEMMs have other shapes than the full
  forward's, so some activations round one bf16 step, 2^-8 relative, the other way, and that compounds over the
  layers). Measured on a CPU (2026-12-05), 2 layers of the Qwen shape, 1,024 tokens: max 3.8e-6 and mean 8.7e-7 in
  float32, max 0.017 and mean 0.0027 under bf16 autocast; 24 layers should stay within a few times that. A real
  error is larger: log-probs that ignore the temperature 0.7 are off by 0.055 on average on the --small model
  (logits of std ~0.16 at init) and, scaling with the logits' spread, ~0.25 on the Qwen shape (std ~0.6); a
  log-prob shifted by one token, by about a nat.
- parity_greedy: generate_completions(..., greedy=True) on the same 2 prompts against a full forward over each
  finished sequence: at every completion token, log_softmax of the full forward's logits at the greedy token must
  be within the parity tolerance (max) of the largest: a near tie may flip under bf16 (measured as above: 1 token of
  128 differed, by 0.016, one bf16 step of its logit); a sampled token instead of the argmax is off by about 2 nats
  on the Qwen shape (the largest of 151,936 logits of std 0.6 stands ~4.5 std above the rest). The exact-match
  fraction is reported.
- throughput: tokens/s of generate_completions and of model.generate (do_sample, top_k=0, top_p=1.0, the same 2
  prompts x 8 completions, max_new_tokens = max_completion_length, the same precision), each warmed up once, then
  timed twice, alternating. Fails only below 0.5x: both run one forward per token with a KV cache and both synchronise
  once per token (ours on `ended.all()`, generate on its stopping criteria), so they should be within the ±30%
  this kind of timing varies by; 0.5x means something gross, such as a lost KV cache (a full forward per token), a
  host-device copy per token, or float64 sampling on a GPU without float64 units.
- branches: the branches that had never run on CUDA: the `branches` run (beta > 0, SSR replace with num_iterations
  2, gradient accumulation 2) and the `dynamic` run (dynamic_sampling, gradient accumulation 2): every step with a
  finite gradient norm > 0, every 2-D weight moved, and each branch visibly taken: a finite `kl` logged, a step that
  did not generate (num_iterations 2) and a step that trained replayed samples, `frac_batch_filled` logged.
- eos: in the `branches` run, some step ended some completions at EOS (frac_truncated < 1, completion_length < 64).
- eval: that run's metrics.jsonl holds held-out lines at steps 0, 3 and 6, each with a finite eval_reward.
- resume: `resumed` (from resume_ref's checkpoint-2) against resume_ref at steps 3-4: reward, loss and grad_norm.
  These two runs train at learning rate 1e-4, not 1e-6, so that the optimizer state restored matters to the
  samples that follow. On a CPU exactly: the same arithmetic on the same inputs in the same order gives the same
  bits. On CUDA both runs use torch.use_deterministic_algorithms and the math attention kernel (the fused attention
  backward adds with atomics, so two identical steps can differ in their last bits, and under bf16 that can change
  a sampled token and everything after), so they should match exactly too; the tolerance only forgives float noise
  should a kernel still not be deterministic: reward within 0.05 (reward_len's mean over 16 integer character
  counts moves in steps of 1/16), loss and grad_norm within 1e-6 + 1e-3 |value| (the loss is ~1e-8 here: each
  sample trains in the step that made it, ratio 1, and the advantages sum to 0). A resume that loses the RNG state
  samples other completions: the reward moves by whole characters. One that loses the optimizer state changed, on
  the --small model on a CPU (2026-12-05), step 4's grad_norm by 2.3% (0.559 to 0.546), 20 times the CUDA
  tolerance; on the tiny model at lr 1e-3 (2026-12-03), the reward by 1.25 and the loss by 0.05.
- lean_logps: grpo_ssr.lean_logps (the logits a chunk of 128 tokens at a time) against grpo_ssr.per_token_logps (all
  logits at once) on the benchmark model, on the device and in its precision, 4 rows of 64 prompt and 256
  completion tokens (32 and 48 with --small), one left-padded, one ended early, temperature 0.7: the log-probs (max
  |difference|) and the gradient of sum(w * logps) over all parameters (relative norm of the difference).
  Tolerances 1e-4 and 1e-4 in float32, 5e-2 and 5e-2 under bf16 autocast (measured on a CPU with AMX, 2 layers of
  the Qwen shape: 1.9e-6 and 5.0e-7 in float32, 0 and 2.5e-3 in bf16). It also fails if lean_logps fell back to the
  full path (the output head module ran): then nothing was compared.

With --device cpu, memory prints "needs CUDA" (it still reports the bound), and every other check runs.

How long on one H200 (not yet run on one; no GPU was lent to the session that wrote this). The Qwen-shaped work is
20 generation calls of 256 tokens (6 benchmark steps, 6 resume steps, 2 parity, 6 throughput, 3 of which are
model.generate's, measured here at about half our speed: count 23), 12 training forward/backward passes of 16 x
~400 tokens, and ~12 GB written (the model at the end of 3 runs, 2 GB each; one checkpoint, 6 GB). Decoding a 0.5B
model at batch 16 is bound by the host, not the GPU (a token reads 1 GB of bf16 weights: 0.3 ms at 4.8 TB/s), so
a decode step costs what Python and the ~400 kernel launches of 24 layers cost. Measured on a 2-core AMD EPYC
(2026-12-05), a decode step of a 24-layer Qwen2 of hidden 64 (the same Python and op count, negligible
arithmetic), one thread: 24 ms at load average 2, 69 ms at 5.8. Taking 24 ms as the H200 host's cost per token:
23 x 256 x 24 ms = 141 s; the training passes, 6 x 494M parameters x 6,400 tokens x 12 = 2.3e14 FLOP, under 10 s
at a quarter of the bf16 peak; the writes about 30 s; the builds, imports and tiny runs about 60 s (the whole
--small dry run takes 35 s of CPU here): about 4 minutes. With the host's cost at the contended 69 ms a token it
would be about 8 minutes, the limit. The JSON line records each check's seconds and the total, so the first GPU
run measures it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402  (puts the repository root on sys.path)
import grpo_ssr  # noqa: E402

QWEN2_0_5B_INSTRUCT = dict(
    vocab_size=151_936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32_768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    use_sliding_window=False,
)
SMALL = dict(
    QWEN2_0_5B_INSTRUCT,
    vocab_size=8192,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

CHECKS = (
    "benchmark",
    "precision",
    "memory",
    "steps",
    "weights_move",
    "bf16_model",
    "parity_sampled",
    "parity_greedy",
    "throughput",
    "branches",
    "eos",
    "eval",
    "resume",
    "lean_logps",
)
NEEDS_CUDA = "needs CUDA"
COMPLETIONS = 16  # completions a step in every run, 8 per prompt
BRANCHES = dict(max_steps=6, eval_steps=3, max_completion_length=64)  # the tiny `branches` run
RESUME = dict(max_steps=4, save_steps=2, learning_rate=1e-4)  # resume_ref (Qwen shape); `resumed` from checkpoint-2
# (rel, abs) for each compared metric of the resumed steps: see the docstring
RESUME_TOLERANCE = {
    "cpu": {"reward": (0.0, 0.0), "loss": (0.0, 0.0), "grad_norm": (0.0, 0.0)},
    "cuda": {"reward": (0.0, 0.05), "loss": (1e-3, 1e-6), "grad_norm": (1e-3, 1e-6)},
}
LEAN_TOLERANCE = {"float32": (1e-4, 1e-4), "bf16 autocast": (5e-2, 5e-2)}  # (log-probs max abs, gradients rel)
PARITY_TOLERANCE = {"float32": (1e-3, 1e-3), "bf16 autocast": (0.3, 0.03)}  # (max abs, mean abs), in nats
MIN_MOVED = 0.5  # of the 2-D weights' elements, in a run that starts from initial weights: see weights_move
MIN_SPEED_RATIO = 0.5  # generate_completions' tokens/s over model.generate's: below this, throughput fails
STEP_KEYS = ("loss", "grad_norm", "skipped", "nonfinite_steps", "skipped_steps")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda (exits 2 when torch sees none) or cpu for a dry run",
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="2 layers, hidden 64, vocabulary 8,192, 32 new tokens: a fast dry run of the same path",
    )
    p.add_argument("--steps", type=int, default=None, help="steps of the benchmark run (default 6; 4 with --small)")
    p.add_argument("--warmup", type=int, default=2, help="steps (and generation calls) left out of the timings")
    p.add_argument("--max_completion_length", type=int, default=None, help="default 256; 32 with --small")
    p.add_argument("--logits_chunk_size", type=int, default=None, help="the runs' chunk; default grpo_ssr's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traceback", action="store_true", help="print the traceback of a check that raised")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------------
# The verdicts: small functions of a run's metrics, so that each can be tested on a hand-built history
# ----------------------------------------------------------------------------------------------------------------------


def finite(value) -> bool:
    """A real number that is not NaN or infinite (metrics.jsonl writes NaN as null: not finite either)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def step_failures(history: list[dict]) -> list[str]:
    """What is wrong with a run's training lines: a missing or non-finite loss or gradient norm, a gradient norm of 0,
    a skipped step, a non-zero nonfinite_steps or skipped_steps counter, or no step at all. Empty when every step
    trained."""
    if not history:
        return ["no training step"]
    problems = []
    for row in history:
        step = row.get("step", "?")
        missing = [key for key in STEP_KEYS if key not in row]
        if missing:
            problems.append(f"step {step}: no {', '.join(missing)}")
        for key in ("loss", "grad_norm"):
            if key in row and not finite(row[key]):
                problems.append(f"step {step}: {key} {row[key]}")
        if finite(row.get("grad_norm")) and not row["grad_norm"] > 0:
            problems.append(f"step {step}: grad_norm {row['grad_norm']}: no gradient")
        if row.get("skipped", 0) != 0:
            problems.append(f"step {step}: skipped")
    for key in ("nonfinite_steps", "skipped_steps"):  # counters of the run so far
        worst = max((row[key] for row in history if finite(row.get(key))), default=0)
        if worst != 0:
            problems.append(f"{key} {worst}")
    return problems


def eos_failures(history: list[dict], max_completion_length: int) -> list[str]:
    """Empty when some step ended some completions at EOS: frac_truncated < 1 and completion_length < the maximum."""
    if not history:
        return ["no training step"]
    for row in history:
        truncated = row.get("frac_truncated")
        length = row.get("completion_length")
        if finite(truncated) and finite(length) and truncated < 1 and length < max_completion_length:
            return []
    seen = [(row.get("frac_truncated"), row.get("completion_length")) for row in history]
    return [f"no completion ended before {max_completion_length} tokens: (frac_truncated, completion_length) {seen}"]


def eval_failures(rows: list[dict], expected_steps: list[int]) -> list[str]:
    """Empty when metrics.jsonl's held-out lines are exactly at `expected_steps`, each with a finite eval_reward."""
    evals = [row for row in rows if "eval_reward" in row]
    steps = [row.get("step") for row in evals]
    problems = [] if steps == expected_steps else [f"held-out lines at steps {steps}, expected {expected_steps}"]
    problems += [
        f"step {row.get('step')}: eval_reward {row['eval_reward']}" for row in evals if not finite(row["eval_reward"])
    ]
    return problems


def resume_failures(reference: list[dict], resumed: list[dict], from_step: int, tolerance: dict) -> list[str]:
    """Empty when the resumed run has exactly the reference's steps after `from_step`, and at each every metric of
    `tolerance` ({"reward": (rel, abs), ...}) within |a - b| <= abs + rel |b| of the reference's (0, 0: bit for bit)."""
    want = {row["step"]: row for row in reference if row["step"] > from_step}
    got = {row["step"]: row for row in resumed}
    if not want or sorted(got) != sorted(want):
        return [f"resumed steps {sorted(got)}, expected {sorted(want)}"]
    problems = []
    for step, row in sorted(got.items()):
        for key, (rel, abs_) in tolerance.items():
            a, b = row.get(key), want[step].get(key)
            if not (finite(a) and finite(b) and abs(a - b) <= abs_ + rel * abs(b)):
                problems.append(f"step {step}: {key} {a!r} resumed, {b!r} uninterrupted")
    return problems


def verdict(problems: list[str], shown: int = 3) -> str:
    """ "pass", or "fail: " and the first few problems, on one line."""
    if not problems:
        return "pass"
    text = "; ".join(problems[:shown]) + (f" (+{len(problems) - shown} more)" if len(problems) > shown else "")
    return "fail: " + " ".join(text.split())


def describe(error: BaseException) -> str:
    """An exception on one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return type(error).__name__ + (f": {lines[0]}" if lines else "")


def clean(value):
    """For the JSON line: floats to 6 significant digits, NaN and infinities as the strings "nan", "inf" (strict
    JSON has neither)."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else str(value)
    return value


def expected_precision(device: torch.device) -> str:
    """What grpo_ssr.pick_device must choose by default: bf16 autocast on a GPU with native bf16 (compute capability
    8.0 or later: A100, H100, H200, RTX 30xx and later), else float32."""
    native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
    return "bf16 autocast" if native else "float32"


def precision_failures(runs: dict, expected: str) -> list[str]:
    """Empty when every run's grpo_config.json says `expected` and its first Linear layer computed in that dtype
    and no other."""
    want = {"bf16 autocast": ["torch.bfloat16"], "float32": ["torch.float32"]}[expected]
    problems = []
    for name, run in runs.items():
        if run["record"].get("precision") != expected:
            problems.append(f"{name}: grpo_config.json says {run['record'].get('precision')!r}, expected {expected!r}")
        if run["dtypes"] != want:
            problems.append(f"{name}: its Linear layers computed in {run['dtypes']}, expected {want}")
    return problems


def memory_failures(peak: int | None, weights: int, bound: float) -> list[str]:
    """Empty when the peak allocated bytes are at least the weights' (the run used the device) and within the bound."""
    if peak is not None and weights <= peak <= bound:
        return []
    gib = [None if x is None else round(x / 2**30, 2) for x in (peak, weights, bound)]
    return [f"peak {gib[0]} GiB, outside [{gib[1]}, {gib[2]}] GiB (the weights' bytes, the bound)"]


def branch_failures(rows: list[dict], record: dict, features: dict) -> list[str]:
    """Empty when grpo_config.json has each of `features` ({field: value}) and the training lines show each taken."""
    problems = [
        f"grpo_config.json has {k} {record.get(k)!r}, not {v!r}" for k, v in features.items() if record.get(k) != v
    ]
    if features.get("beta", 0) > 0 and not any(finite(row.get("kl")) for row in rows):
        problems.append("beta > 0 but no step logged a finite kl")
    if features.get("num_iterations", 1) > 1 and all(row.get("generated") == 1 for row in rows):
        problems.append("num_iterations > 1 but every step generated")
    if features.get("ssr_mode") == "replace" and not any(row.get("replay_frac", 0) > 0 for row in rows):
        problems.append("SSR replace but no step trained a replayed sample (replay_frac 0)")
    if features.get("dynamic_sampling") and not any(finite(row.get("frac_batch_filled")) for row in rows):
        problems.append("dynamic_sampling but no step logged frac_batch_filled")
    return problems


# ----------------------------------------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------------------------------------


def build(model_kwargs: dict, device: torch.device):
    """Tokenizer padded to the vocabulary, and a random Qwen2 built directly on the device."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = grpo_ssr.build_tiny_tokenizer(extra_tokens=model_kwargs["vocab_size"] - 258)
    assert len(tokenizer) == model_kwargs["vocab_size"], (len(tokenizer), model_kwargs["vocab_size"])
    config = Qwen2Config(
        **model_kwargs,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with device:
        model = Qwen2ForCausalLM(config)
    # As grpo_ssr.load_model does: plain sampling, no generation defaults carried in.
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model, tokenizer


def tiny_model(seed: int):
    torch.manual_seed(seed)
    return grpo_ssr.load_model("tiny")


def first_linear(model) -> torch.nn.Linear:
    """The first Linear layer of the body: it runs in every forward, generation and training alike."""
    return next(m for m in model.base_model.modules() if isinstance(m, torch.nn.Linear))


def moved_fraction(before: dict, model) -> float:
    """The fraction of the elements of the 2-D weights in `before` (CPU copies) that differ from the model's now.
    Elements, not tensors: in a model left in bf16 the few weights within ~1e-4 of 0 still move at lr 1e-6."""
    now = dict(model.named_parameters())
    moved = sum(int((now[n].detach().cpu().float() != p.float()).sum()) for n, p in before.items())
    return moved / max(1, sum(p.numel() for p in before.values()))


def train_run(fields: dict, model, tokenizer, eval_rows: list[dict] | None = None) -> dict:
    """GRPOTrainer(cfg, model=..., processing_class=...).train() in fields["output_dir"]. Returns its training lines
    (`history`), grpo_config.json (`record`), every line of metrics.jsonl (`rows`), the dtypes the first Linear layer
    computed in (`dtypes`), the fraction of 2-D weight elements that moved (`moved`), the peak CUDA memory allocated
    after the trainer was built (`peak`), and the `trainer`. What train() prints goes to stderr: stdout is the
    checks'."""
    before = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.dim() == 2}
    trainer = grpo_ssr.GRPOTrainer(
        grpo_ssr.GRPOConfig(**fields),
        model=model,
        processing_class=tokenizer,
        train_dataset=grpo_ssr.builtin_prompts(),
        eval_dataset=eval_rows,
    )
    grpo_ssr.lean_head(trainer.model)  # its one probe runs with autocast off, by design: before the hook sees it
    dtypes = set()
    hook = first_linear(trainer.model).register_forward_hook(lambda module, args, out: dtypes.add(str(out.dtype)))
    cuda = trainer.device.type == "cuda"
    if cuda:  # the model is on the device now: the peak from here is the run's
        torch.cuda.synchronize(trainer.device)
        torch.cuda.reset_peak_memory_stats(trainer.device)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            history = trainer.train()
    finally:
        hook.remove()
    peak = torch.cuda.max_memory_allocated(trainer.device) if cuda else None
    out = Path(fields["output_dir"])
    return dict(
        history=history,
        record=json.loads((out / "grpo_config.json").read_text()),
        rows=[json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
        dtypes=sorted(dtypes),
        moved=moved_fraction(before, model),
        peak=peak,
        trainer=trainer,
    )


def qwen_fields(args, output_dir: Path, max_steps: int, **more) -> dict:
    chunk = {} if args.logits_chunk_size is None else {"logits_chunk_size": args.logits_chunk_size}
    fields = dict(
        output_dir=str(output_dir),
        device=args.device,
        seed=args.seed,
        max_steps=max_steps,
        learning_rate=1e-6,
        per_device_train_batch_size=COMPLETIONS,
        num_generations=8,
        max_completion_length=args.max_completion_length,
        replay_buffer_class="SSRReplayBuffer",
        eval_steps=0,
        **chunk,
    )
    return {**fields, **more}


def tiny_fields(args, output_dir: Path, **more) -> dict:
    fields = dict(output_dir=str(output_dir), device=args.device, seed=args.seed, num_generations=8, eval_steps=0)
    fields.update(per_device_train_batch_size=COMPLETIONS // 2, gradient_accumulation_steps=2)
    return {**fields, **more}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedGeneration:
    """Wraps grpo_ssr.generate_completions, which GRPOTrainer looks up in the module at each call: the seconds and
    completion tokens of each call, synchronised with the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls = []  # (seconds, completion tokens)
        self.original = grpo_ssr.generate_completions

    def __call__(self, *args, **kwargs):
        sync(self.device)
        start = time.perf_counter()
        out = self.original(*args, **kwargs)
        sync(self.device)
        self.calls.append((time.perf_counter() - start, int(out["completion_mask"].sum())))
        return out

    def __enter__(self):
        grpo_ssr.generate_completions = self
        return self

    def __exit__(self, *exc):
        grpo_ssr.generate_completions = self.original


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [row.get(key) for row in rows]
    return round(sum(values) / len(values), 4) if values and all(map(finite, values)) else None


# ----------------------------------------------------------------------------------------------------------------------
# Peak memory: the bound it must stay under
# ----------------------------------------------------------------------------------------------------------------------


def saved_bytes_per_token(model, autocast) -> float:
    """The bytes autograd saves for backward per token of a forward of the model's body (no head), measured: two
    lengths, so that what does not grow with the tokens (the weights, their bf16 copies) cancels."""
    device = next(model.parameters()).device
    saved = []
    for length in (64, 128):
        ids = torch.randint(model.config.vocab_size, (2, length), device=device)
        mask = torch.ones_like(ids)
        mask[0, 0] = 0  # a padded row, as in training: the attention kernel that takes a mask
        storages = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
            model.base_model(input_ids=ids, attention_mask=mask, use_cache=False)
        saved.append(sum(storages.values()))
    return (saved[1] - saved[0]) / (2 * 64)


def memory_bound(model, autocast, bf16: bool, micro_batch_tokens: int, rows: int, length: int, chunk: int) -> dict:
    """The terms of the bound on a run's peak allocated memory, in bytes, and the bound (see the docstring)."""
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    per_token = saved_bytes_per_token(model, autocast)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * (2 if bf16 else 4)
    terms = dict(
        state=params * (24 + (2 if bf16 else 0)),  # weights, gradients, AdamW's 2 moments and foreach temporaries; bf16
        activations=per_token * micro_batch_tokens * (1 + 2 / config.num_hidden_layers),  # + backward's transients
        head=chunk * config.vocab_size * 24,  # HeadLogProbs: (chunk, V) float32 z and g, their bf16 GEMM outputs
        generation=rows * length * kv_per_token + 3 * rows * config.vocab_size * 8,  # KV cache; sampling's float64
    )
    return dict(terms, saved_bytes_per_token=per_token, bound=1.25 * sum(terms.values()) + 2**30)


# ----------------------------------------------------------------------------------------------------------------------
# Generation against the log-probs the loss uses, and against model.generate
# ----------------------------------------------------------------------------------------------------------------------


def prompts(tokenizer) -> list[str]:
    return grpo_ssr.prompt_texts(grpo_ssr.builtin_prompts()[:2], tokenizer)


def full_sequence(out: dict) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    return ids, torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)


def sampled_parity(model, tokenizer, autocast, precision: str, length: int, chunk: int, measured: dict) -> list[str]:
    """Each sampled token's log-prob in the decode loop against grpo_ssr.lean_logps on the finished batch."""
    temperature = 0.7
    decoded = []  # (B,) per decode step: log_softmax(logits / T) at the drawn token
    real = grpo_ssr.sample_next_token

    def recording(logits, temperature=1.0):
        token = real(logits, temperature)
        decoded.append(torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, token[:, None])[:, 0])
        return token

    model.eval()
    grpo_ssr.sample_next_token = recording
    try:
        with torch.no_grad(), autocast():
            out = grpo_ssr.generate_completions(model, tokenizer, prompts(tokenizer), 8, 512, length, temperature)
    finally:
        grpo_ssr.sample_next_token = real
    ids, mask = full_sequence(out)
    with torch.no_grad(), autocast():
        lean = grpo_ssr.lean_logps(model, ids, mask, out["completion_ids"].size(1), temperature, chunk_size=chunk)
    kept = out["completion_mask"].bool()  # (B, C)
    if len(decoded) != kept.size(1):
        return [f"{len(decoded)} sampling calls for {kept.size(1)} completion tokens"]
    diff = (torch.stack(decoded, dim=1) - lean.float()).abs()[kept]  # (kept tokens,)
    max_abs, mean_abs = PARITY_TOLERANCE[precision]
    measured.update(tokens=int(kept.sum()), max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item())
    problems = []
    if not diff.isfinite().all():
        problems.append("non-finite log-probs")
    if measured["max_abs_diff"] > max_abs or measured["mean_abs_diff"] > mean_abs:
        problems.append(
            f"decode-loop log-probs differ from lean_logps' by up to {measured['max_abs_diff']:.3g}, "
            f"{measured['mean_abs_diff']:.3g} on average (> {max_abs:g}, {mean_abs:g})"
        )
    return problems


def greedy_parity(model, tokenizer, autocast, precision: str, length: int, measured: dict) -> list[str]:
    """Greedy decoding against the argmax of a full forward over the finished sequences."""
    model.eval()
    with torch.no_grad(), autocast():
        out = grpo_ssr.generate_completions(model, tokenizer, prompts(tokenizer), 1, 512, length, greedy=True)
        ids, mask = full_sequence(out)
        positions = grpo_ssr.positions_from_mask(mask)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    completion = out["completion_ids"]  # (P, C)
    logps = torch.log_softmax(logits[:, -completion.size(1) - 1 : -1].float(), dim=-1)  # (P, C, V)
    gap = logps.amax(dim=-1) - logps.gather(-1, completion[..., None])[..., 0]  # (P, C): 0 where greedy is the argmax
    kept = out["completion_mask"].bool()
    tolerance = PARITY_TOLERANCE[precision][0]
    measured.update(tokens=int(kept.sum()), max_gap=gap[kept].max().item())
    measured["argmax_match_frac"] = (logps.argmax(dim=-1) == completion)[kept].float().mean().item()
    if not measured["max_gap"] <= tolerance:
        return [
            f"a greedy token is {measured['max_gap']:.3g} nats below the full forward's most likely (> {tolerance:g})"
        ]
    return []


def throughput(model, tokenizer, autocast, length: int, device: torch.device, measured: dict) -> list[str]:
    """Tokens/s of generate_completions and of model.generate, same batch and precision: warmed up, then alternated."""
    texts = prompts(tokenizer)
    eos = grpo_ssr.eos_token_ids(model, tokenizer)

    def ours() -> int:
        return int(grpo_ssr.generate_completions(model, tokenizer, texts, 8, 512, length)["completion_mask"].sum())

    def theirs() -> int:
        encoded = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt").to(device)
        new = model.generate(
            **encoded,
            do_sample=True,
            top_k=0,  # transformers 5 fills None with 50 (FACTS.md): 0 samples from the whole distribution, as ours
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=length,
            num_return_sequences=8,
        )[:, encoded.input_ids.size(1) :]
        return int(grpo_ssr.completion_mask_from_eos(new, eos).sum())

    timed = {"ours": [0.0, 0], "generate": [0.0, 0]}  # seconds, tokens
    model.eval()
    with torch.no_grad(), autocast():
        for rep in range(3):
            for name, fn in (("ours", ours), ("generate", theirs)):
                sync(device)
                start = time.perf_counter()
                tokens = fn()
                sync(device)
                if rep > 0:  # the first of each is the warm-up
                    timed[name][0] += time.perf_counter() - start
                    timed[name][1] += tokens
    speed = {name: tokens / seconds for name, (seconds, tokens) in timed.items()}
    measured.update(ours_tokens_per_s=speed["ours"], generate_tokens_per_s=speed["generate"])
    measured["ratio"] = speed["ours"] / speed["generate"]
    if not measured["ratio"] >= MIN_SPEED_RATIO:
        return [f"generate_completions at {measured['ratio']:.2f}x model.generate's tokens/s (< {MIN_SPEED_RATIO})"]
    return []


# ----------------------------------------------------------------------------------------------------------------------
# The lean log-prob path against the full one
# ----------------------------------------------------------------------------------------------------------------------


def lean_check(model, device: torch.device, precision: str, small: bool, seed: int, measured: dict) -> list[str]:
    """lean_logps against per_token_logps: same inputs, values and gradients (see the module docstring). What it
    measured goes into `measured`."""
    max_abs, max_rel = LEAN_TOLERANCE[precision]
    rows, prompt, completion = (4, 32, 48) if small else (4, 64, 256)
    chunk_size, temperature = 128 if not small else 64, 0.7
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (rows, prompt + completion), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[1, : prompt // 2] = 0  # a left-padded prompt
    mask[2, prompt + completion // 2 :] = 0  # a completion that ended early
    kept = mask[:, prompt:].bool()  # (rows, completion): the tokens compared
    weights = torch.randn(rows, completion, generator=generator).to(device) * kept
    if precision == "bf16 autocast":
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    model.eval()
    with torch.no_grad(), autocast():  # a first call, before the hook: the lean path may probe the model once
        grpo_ssr.lean_logps(model, ids[:1], mask[:1], 8, temperature, chunk_size=chunk_size)
    head_calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *a: head_calls.append(1))

    def logps_and_grads(fn):
        model.zero_grad(set_to_none=True)
        with autocast():
            logps = fn(model, ids, mask, completion, temperature)
        (logps.float() * weights).sum().backward()
        grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
        return logps.detach().float(), grads

    try:
        lean, lean_grads = logps_and_grads(
            lambda *a: grpo_ssr.lean_logps(*a, chunk_size=chunk_size),
        )
        lean_head_calls = len(head_calls)
        full, full_grads = logps_and_grads(grpo_ssr.per_token_logps)
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    problems = []
    if lean_head_calls:
        problems.append("lean_logps ran the output head module: it fell back to the full path, nothing compared")
    if len(head_calls) == lean_head_calls:
        problems.append("per_token_logps never ran the output head: the hook that tells the paths apart is broken")
    if lean.shape != (rows, completion) or full.shape != (rows, completion):
        return problems + [f"log-probs of shape {tuple(lean.shape)} and {tuple(full.shape)}, not {(rows, completion)}"]
    if not (lean[kept].isfinite().all() and full[kept].isfinite().all()):
        return problems + ["non-finite log-probs"]
    value_diff = (lean - full).abs()[kept].max().item()
    measured.update(logps_max_abs_diff=value_diff, tolerance=[max_abs, max_rel])
    if value_diff > max_abs:
        problems.append(f"log-probs differ by up to {value_diff:.3g} (> {max_abs:g})")
    if sorted(lean_grads) != sorted(full_grads):
        return problems + [f"gradients of {len(lean_grads)} and {len(full_grads)} parameters"]
    diff_sq = sum(float((lean_grads[n] - full_grads[n]).pow(2).sum()) for n in full_grads)
    norm_sq = sum(float(full_grads[n].pow(2).sum()) for n in full_grads)
    if not (math.isfinite(diff_sq) and math.isfinite(norm_sq) and norm_sq > 0):
        return problems + [f"gradient norms not finite or zero: |diff|^2 {diff_sq}, |full|^2 {norm_sq}"]
    grad_rel = math.sqrt(diff_sq / norm_sq)
    if grad_rel > max_rel:
        problems.append(f"gradients differ by {grad_rel:.3g} relative (> {max_rel:g})")
    measured["grads_rel_diff"] = grad_rel
    return problems


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


class Session:
    """The runs of one gpu_check and the checks on them: each check_* method returns its problems (empty: pass), or
    NEEDS_CUDA; what it measured goes into self.measured[name]."""

    def __init__(self, args, device: torch.device, shape: dict, folder: Path, result: dict):
        self.args, self.device, self.shape, self.folder, self.result = args, device, shape, folder, result
        self.checks = dict.fromkeys(CHECKS, "fail: not run")
        self.measured = {name: {} for name in CHECKS}
        self.seconds = {}
        self.runs = {}  # run name -> train_run's result, less its trainer
        self.trainer = None  # the ssr run's, for the checks on its model
        self.precision = expected_precision(device)

    def attempt(self, name: str) -> None:
        """checks[name] from check_<name>()'s problems; an exception fails that check, on one line."""
        start = time.perf_counter()
        try:
            outcome = getattr(self, f"check_{name}")()
            self.checks[name] = outcome if outcome == NEEDS_CUDA else verdict(outcome)
        except Exception as error:  # a crash is a failed check, reported with the others
            self.checks[name] = f"fail: {describe(error)}"
            if self.args.traceback:
                traceback.print_exc()
        finally:
            self.seconds[name] = round(time.perf_counter() - start, 1)
            free_memory(self.device)

    def run(self, name: str, fields: dict, model, tokenizer, eval_rows=None) -> dict:
        run = train_run(fields, model, tokenizer, eval_rows)
        self.runs[name] = {k: v for k, v in run.items() if k != "trainer"}
        return run

    def qwen(self):
        torch.manual_seed(self.args.seed)
        return build(self.shape, self.device)

    def check_benchmark(self) -> list[str]:
        args, result = self.args, self.result
        start = time.perf_counter()
        model, tokenizer = self.qwen()
        result["build_s"] = round(time.perf_counter() - start, 2)
        result["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
        with TimedGeneration(self.device) as timer:
            run = self.run("ssr", qwen_fields(args, self.folder / "ssr", result["steps"]), model, tokenizer)
        self.trainer = run["trainer"]
        history = run["history"]
        measured = timer.calls[args.warmup :]
        seconds = sum(call[0] for call in measured)
        result.update(
            step_s=mean_of(history[args.warmup :], "step_time"),
            gen_tokens_per_s=round(sum(call[1] for call in measured) / seconds, 1) if seconds else None,
            gen_calls_measured=len(measured),
            completion_tokens_mean=mean_of(history[args.warmup :], "completion_length"),
            loss=history[-1].get("loss") if history else None,
            logits_chunk_size=run["record"].get("logits_chunk_size"),
        )
        problems = [] if len(history) == result["steps"] else [f"{len(history)} lines for {result['steps']} steps"]
        if not measured:
            problems.append(f"the generation timer saw {len(timer.calls)} calls, none after the {args.warmup} warm-up")
        if result["step_s"] is None:
            problems.append("step_time missing or not finite after the warm-up")
        return problems

    def check_precision(self) -> list[str]:
        self.measured["precision"].update(expected=self.precision, ran={n: r["dtypes"] for n, r in self.runs.items()})
        if self.device.type == "cuda":
            self.measured["precision"]["capability"] = list(torch.cuda.get_device_capability(self.device))
        return precision_failures(self.runs, self.precision) if self.runs else ["no run finished"]

    def check_memory(self) -> list[str] | str:
        trainer, measured = self.trainer, self.measured["memory"]
        cfg = trainer.cfg
        texts = grpo_ssr.prompt_texts(trainer.dataset, trainer.tokenizer)
        longest = min(max(len(ids) for ids in trainer.tokenizer(texts).input_ids), cfg.max_prompt_length)
        tokens = cfg.per_device_train_batch_size * (longest + cfg.max_completion_length)
        bound = memory_bound(
            trainer.model,
            trainer.autocast,
            self.precision == "bf16 autocast",
            tokens,
            cfg.generation_batch_size,
            longest + cfg.max_completion_length,
            cfg.logits_chunk_size,
        )
        measured.update({k: round(v / 2**30, 3) for k, v in bound.items() if k != "saved_bytes_per_token"})
        measured.update(micro_batch_tokens=tokens, saved_bytes_per_token=round(bound["saved_bytes_per_token"]))
        if self.device.type != "cuda":
            return NEEDS_CUDA
        peak = self.runs["ssr"]["peak"]
        weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        measured.update(peak_gib=round(peak / 2**30, 3), weights_gib=round(weights / 2**30, 3))
        return memory_failures(peak, weights, bound["bound"])

    def check_parity_sampled(self) -> list[str]:
        t = self.trainer
        chunk = t.cfg.logits_chunk_size
        length = t.cfg.max_completion_length
        args = (t.model, t.tokenizer, t.autocast, self.precision, length, chunk, self.measured["parity_sampled"])
        return sampled_parity(*args)

    def check_parity_greedy(self) -> list[str]:
        t = self.trainer
        length = t.cfg.max_completion_length
        return greedy_parity(t.model, t.tokenizer, t.autocast, self.precision, length, self.measured["parity_greedy"])

    def check_throughput(self) -> list[str]:
        t = self.trainer
        length = t.cfg.max_completion_length
        return throughput(t.model, t.tokenizer, t.autocast, length, self.device, self.measured["throughput"])

    def check_lean_logps(self) -> list[str]:
        model = self.trainer.model
        self.trainer = None  # the last check on the ssr model: free it after
        return lean_check(
            model, self.device, self.precision, self.args.small, self.args.seed, self.measured["lean_logps"]
        )

    def check_resume(self) -> list[str]:
        middle = RESUME["save_steps"]
        deterministic = self.device.type == "cuda"  # the docstring says why
        with contextlib.ExitStack() as stack:
            if deterministic:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                torch.use_deterministic_algorithms(True, warn_only=True)
                stack.callback(torch.use_deterministic_algorithms, False)
                stack.enter_context(sdpa_kernel(SDPBackend.MATH))
            fields = qwen_fields(self.args, self.folder / "ref", **RESUME)
            reference = self.run("resume_ref", fields, *self.qwen())
            del reference["trainer"]  # its model and optimizer state: freed before the next run builds its own
            free_memory(self.device)
            checkpoint = self.folder / "ref" / f"checkpoint-{middle}"
            fields = qwen_fields(self.args, self.folder / "resumed", **RESUME, resume_from_checkpoint=str(checkpoint))
            resumed = self.run("resumed", fields, *self.qwen())
        tolerance = RESUME_TOLERANCE[self.device.type]
        self.measured["resume"].update(steps=[row["step"] for row in resumed["history"]], tolerance=tolerance)
        return resume_failures(reference["history"], resumed["history"], middle, tolerance)

    def check_bf16_model(self) -> list[str]:
        model, tokenizer = tiny_model(self.args.seed)
        model.to(torch.bfloat16)
        fields = tiny_fields(self.args, self.folder / "bf16", max_steps=3, learning_rate=1e-6)
        run = self.run("bf16", fields, model, tokenizer)
        optimizer = run["trainer"].optimizer
        dtypes = sorted({str(p.dtype) for p in run["trainer"].model.parameters()})
        state = sorted(
            {str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")}
        )
        self.measured["bf16_model"].update(param_dtypes=dtypes, exp_avg_dtypes=state, moved=run["moved"])
        problems = [] if dtypes == ["torch.float32"] else [f"the trained model's parameters are {dtypes}, not float32"]
        if state != ["torch.float32"]:
            problems.append(f"AdamW's exp_avg/exp_avg_sq are {state or 'absent'}, not float32")
        if run["moved"] < MIN_MOVED:
            problems.append(f"{run['moved']:.1%} of the 2-D weights' elements moved in 3 steps at lr 1e-6")
        return problems

    def check_branches(self) -> list[str]:
        """The `branches` run (with the held-out prompts: the eos and eval checks read it) and the `dynamic` run."""
        problems = []
        features = {
            "branches": dict(beta=0.04, replay_buffer_class="SSRReplayBuffer", ssr_mode="replace", num_iterations=2),
            "dynamic": dict(dynamic_sampling=True, replay_buffer_class="ReplayBuffer", max_steps=3, eval_steps=0),
        }
        for name, more in features.items():
            model, tokenizer = tiny_model(self.args.seed)
            fields = tiny_fields(self.args, self.folder / name, **{**BRANCHES, **more})
            held_out = grpo_ssr.builtin_prompts(heldout=True) if name == "branches" else None
            try:
                run = self.run(name, fields, model, tokenizer, held_out)
            except Exception as error:
                problems.append(f"{name}: {describe(error)}")
                continue
            shown = {**more, "gradient_accumulation_steps": 2}
            problems += [f"{name}: {p}" for p in step_failures(run["history"])]
            problems += [f"{name}: {p}" for p in branch_failures(run["history"], run["record"], shown)]
            if run["moved"] < MIN_MOVED:
                problems.append(f"{name}: {run['moved']:.1%} of the 2-D weights' elements moved")
        return problems

    def check_eos(self) -> list[str]:
        if "branches" not in self.runs:
            return ["the branches run did not finish"]
        return eos_failures(self.runs["branches"]["history"], BRANCHES["max_completion_length"])

    def check_eval(self) -> list[str]:
        if "branches" not in self.runs:
            return ["the branches run did not finish"]
        steps = list(range(0, BRANCHES["max_steps"] + 1, BRANCHES["eval_steps"]))
        return eval_failures(self.runs["branches"]["rows"], steps)

    def check_steps(self) -> list[str]:
        """Every run, after the others: each must have finished, every step trained with finite numbers."""
        problems = [f"{name}: did not finish" for name in RUNS if name not in self.runs]
        for name, run in self.runs.items():
            problems += [f"{name}: {p}" for p in step_failures(run["history"])]
        return problems

    def check_weights_move(self) -> list[str]:
        """Every run that starts from initial weights (`resumed` starts from a checkpoint's)."""
        moved = {name: run["moved"] for name, run in self.runs.items() if name != "resumed"}
        self.measured["weights_move"].update(moved)
        return [
            f"{name}: {f:.1%} of the 2-D weights' elements moved" for name, f in moved.items() if f < MIN_MOVED
        ] or ([] if moved else ["no run finished"])


RUNS = ("ssr", "resume_ref", "resumed", "bf16", "branches", "dynamic")
ORDER = ("benchmark", "memory", "parity_sampled", "parity_greedy", "throughput", "lean_logps", "resume", "bf16_model")
ORDER += ("branches", "eos", "eval", "precision", "steps", "weights_move")  # the last three read every run


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        build_kind = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        print(
            f"error: gpu_check: torch {torch.__version__} ({build_kind}) sees no CUDA device; run it on a GPU, "
            "or pass --device cpu --small for a dry run",
            file=sys.stderr,
        )
        return 2
    steps = args.steps or (4 if args.small else 6)
    if steps <= args.warmup:
        print(f"error: gpu_check: --steps ({steps}) must exceed --warmup ({args.warmup})", file=sys.stderr)
        return 2
    args.max_completion_length = args.max_completion_length or (32 if args.small else 256)
    device = torch.device(args.device)
    shape = SMALL if args.small else QWEN2_0_5B_INSTRUCT
    result = {
        "check": "gpu_check",
        "date": h.today(),
        "small": args.small,
        "device": args.device,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": h.versions()["transformers"],
        "vocab": shape["vocab_size"],
        "layers": shape["num_hidden_layers"],
        "hidden": shape["hidden_size"],
        "completions_per_step": COMPLETIONS,
        "max_completion_length": args.max_completion_length,
        "steps": steps,
        "warmup": args.warmup,
    }
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        session = Session(args, device, shape, Path(tmp), result)
        for name in ORDER:
            session.attempt(name)
    checks = session.checks
    result.update(
        precision=session.precision,
        measured=session.measured,
        runs={
            name: {k: run[k] for k in ("dtypes", "moved", "peak")} | summary(run) for name, run in session.runs.items()
        },
        seconds=dict(session.seconds, total=round(time.perf_counter() - start, 1)),
        checks=checks,
    )
    for name in CHECKS:
        shown = json.dumps(clean(session.measured[name])) if session.measured[name] else ""
        print(f"{name}: {checks[name]}" + (f" {shown}" if shown and checks[name] != "fail: not run" else ""))
    print(json.dumps(clean(result)))
    print_row(args, result)
    failed = [f"{name} ({why.removeprefix('fail: ')})" for name, why in checks.items() if why.startswith("fail")]
    if failed:
        print(f"error: gpu_check: {len(failed)} of {len(checks)} checks failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


def summary(run: dict) -> dict:
    """One run in the JSON line: its steps, last loss and reward, and its precision."""
    last = run["history"][-1] if run["history"] else {}
    return dict(steps=len(run["history"]), loss=last.get("loss"), reward=last.get("reward"))


def print_row(args, result: dict) -> None:
    """The README-ready Markdown row of the measurement."""
    name = result["gpu"] or f"CPU ({h.machine()['cpu']})"
    size = "small dry-run model" if args.small else f"Qwen2-0.5B shape ({result.get('params_m')}M params, random)"
    memory = result["measured"]["memory"]
    peak = f"{memory['peak_gib']} GiB (bound {memory['bound']})" if "peak_gib" in memory else "n/a"
    speed = result["measured"]["throughput"].get("ratio")
    passed = sum(v == "pass" for v in result["checks"].values())
    command = "python tests/benchmarks/gpu_check.py" + (" --device cpu --small" if args.small else "")
    columns = ["command", "date", "device", "model", "precision", "gen tokens/s", "vs generate", "s/step"]
    columns += ["peak CUDA memory", "checks", "total s", "torch", "transformers"]
    cells = [f"`{command}`", result["date"], name, size, result["precision"], result.get("gen_tokens_per_s")]
    cells += [f"{speed:.2f}x" if speed else None, result.get("step_s"), peak]
    cells += [f"{passed}/{len(result['checks'])} pass", result["seconds"]["total"], result["torch"]]
    cells += [result["transformers"]]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the Hub
    os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars: stderr keeps the warnings and the verdict
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: the resume check's determinism
    sys.exit(main())
