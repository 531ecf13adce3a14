"""GPU check: grpo_ssr on one CUDA device, measured, and checked so that it cannot pass by doing nothing.

    python tests/benchmarks/gpu_check.py                       # on a GPU machine: a few minutes on one H200
    python tests/benchmarks/gpu_check.py --device cpu --small  # dry run of the same code path on a CPU (~15 s)

Exit status: 0 when every check passed; 1 when one failed, with one line on stderr naming each failed check and why;
2 when it could not start, also with one line on stderr: with the default --device cuda that is a machine where
torch sees no CUDA device (a CPU-only build of torch on a GPU machine fails here, it does not pass).

Nothing is downloaded. The benchmark model is Qwen2ForCausalLM built in code from Qwen2-0.5B-Instruct's
configuration (hidden 896, MLP 4864, 24 layers, 14 attention heads, 2 key/value heads, vocabulary 151,936, tied
embeddings, rope theta 1e6, 32,768 positions; checked against the published config.json) with random weights, and
the tokenizer is grpo_ssr.build_tiny_tokenizer padded with dummy tokens to the same vocabulary. A random model over
152k tokens almost never samples EOS, so its completions run to max_completion_length: a fixed, known amount of work.
--small swaps in 2 layers, hidden 64 and a vocabulary of 8,192.

Every run goes through GRPOTrainer.train() in a temporary folder, as a user's would, and the precision it ran in is
read from that run's grpo_config.json ("bf16 autocast" on a GPU with bf16, else "float32"). The runs:
- ssr: the benchmark. The Qwen-shaped model, SSR buffer (--replay_buffer_class), 16 completions a step, 8 per prompt,
  256 new tokens (32 with --small), learning rate 1e-6, --steps steps (6; 4 with --small).
- uniform: the same model, freshly built, with the other buffer, for 3 steps (2 with --small).
- tiny and resumed: grpo_ssr.load_model("tiny") (vocabulary 258: a random model of it samples EOS about once in 258
  tokens, so some completions stop early; 12-38% a step in the dry run), SSR buffer, 16 completions of at most 64
  tokens, held-out evaluation every 3 steps on builtin_prompts(heldout=True), a checkpoint every 3 steps, 6
  steps; then a fresh trainer with the same settings resumes from checkpoint-3 and runs steps 4-6 again.

The checks, each "pass" or "fail: why" in the JSON line's `checks`:
- benchmark: the ssr run made its --steps steps, and the measurement saw them: the generation timer saw generation
  calls after the warm-up, every step has a step_time and, on CUDA, the peak memory is above 0.
- steps: in every run (ssr, uniform, tiny, resumed), every step has a finite loss and gradient norm, none is skipped
  (skipped == 1) and the counters nonfinite_steps and skipped_steps stay 0 (`step_failures`). A run that raised or
  never ran fails this check too.
- eos: in the tiny run, some step ended some completions at EOS: frac_truncated < 1 and completion_length < 64.
- eval: the tiny run's metrics.jsonl holds held-out lines at steps 0, 3 and 6, each with a finite eval_reward.
- resume: the resumed run's steps 4-6 match the tiny run's in reward and loss. On a CPU exactly: the same arithmetic
  on the same inputs in the same order gives the same bits. On CUDA, reward within 0.05 (absolute) and loss within
  5e-3 + 1e-2 |loss|. Why these: the resumed trainer starts from the same weights, optimizer state, buffer and RNG
  state, and the forward passes (generation, log-probs) are deterministic, so it samples the same completions. Some
  backward kernels are not bitwise reproducible on CUDA (atomic adds in attention's backward), but after AdamW that
  moves a weight by at most a float32 last bit, which very rarely changes its bf16 rounding under autocast; the
  completions stay the same. The reward (reward_len: the mean of 16 integer character counts, so it moves in steps
  of 1/16) then matches exactly, and the loss (with ratio 1 for the completions trained in the step that made them,
  a function of their lengths and advantages) to float noise. A bf16 tolerance of 5e-2 on the loss alone would be
  too loose to mean anything here. Measured on a CPU (2026-12-03), where the loss is 0.07-0.36 and the reward about
  -30: a resume that loses the RNG state changes the reward by 1-6 and the loss by 0.08-0.3 at every resumed step;
  one that loses the optimizer state changes step 5's reward by 1.25 and the loss of steps 5 and 6 by 0.045-0.047.
  Both fail these tolerances; the second would pass rel 5e-2 + abs 5e-2 on the loss.
- buffers: the ssr and uniform runs each recorded its buffer class in grpo_config.json, and neither has a failed step.
- lean_logps: grpo_ssr.lean_logps (the logits a chunk of 128 tokens at a time) against grpo_ssr.per_token_logps (all
  logits at once) on the Qwen-shaped model, on the device and in the precision the runs used: 4 rows of 64 prompt
  tokens and 256 completion tokens (32 and 48 with --small), one row left-padded and one ended early, temperature
  0.7. Compared: the log-probs at every completion token (max |difference|), and the gradient of sum(w * logps),
  w random, over all parameters (||g_lean - g_full|| / ||g_full||). Tolerances: 1e-4 and 1e-4 in float32, where
  both paths compute the same sums in another order; 5e-2 and 5e-2 under bf16 autocast, where both round the same
  bf16 logits but their GEMMs have other shapes, so a logit now and then rounds one bf16 step (2^-8 relative) the
  other way: 5e-2 is about ten such steps. Measured on a CPU with AMX (2026-12-03), 2 layers of the Qwen shape:
  1.9e-6 and 5.0e-7 in float32, 0 and 2.5e-3 under bf16 autocast. A real error is larger: on the --small model, a
  lean path that ignores the temperature is off by 0.49 and 0.30, one whose gradient is 10% too large by 0.10. The
  check also fails if lean_logps ran the output head as a module (it fell back to the full path: nothing compared).

The JSON line also keeps the measurement: generation tokens/s (completion tokens produced, up to and including EOS,
over the seconds inside generate_completions, the first --warmup calls left out), steady-state seconds per step (the
mean step_time of the steps after --warmup), peak CUDA memory of the ssr run (max allocated and reserved), `loss`
and `nonfinite_steps` of its last step, each run's summary in `runs`, the GPU's name, torch and transformers. A
README-ready Markdown row follows it.
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

CHECKS = ("benchmark", "steps", "eos", "eval", "resume", "buffers", "lean_logps")
RUNS = ("ssr", "uniform", "tiny", "resumed")
BUFFERS = ("SSRReplayBuffer", "ReplayBuffer")
COMPLETIONS = 16  # completions a step in every run, 8 per prompt
TINY = dict(max_steps=6, save_steps=3, eval_steps=3, max_completion_length=64)  # the tiny and resumed runs
# (rel, abs) for each compared metric of the resumed steps: see the docstring
RESUME_TOLERANCE = {
    "cpu": {"reward": (0.0, 0.0), "loss": (0.0, 0.0)},
    "cuda": {"reward": (0.0, 0.05), "loss": (1e-2, 5e-3)},
}
LEAN_TOLERANCE = {"float32": (1e-4, 1e-4), "bf16 autocast": (5e-2, 5e-2)}  # (log-probs max abs, gradients rel)
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
    p.add_argument("--replay_buffer_class", default="SSRReplayBuffer", choices=BUFFERS, help="the benchmark's buffer")
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
    """What is wrong with a run's training lines: a missing or non-finite loss or gradient norm, a skipped step, a
    non-zero nonfinite_steps or skipped_steps counter, or no step at all. Empty when every step trained."""
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


def train_run(fields: dict, model, tokenizer, eval_rows: list[dict] | None = None) -> tuple[list[dict], dict, list]:
    """GRPOTrainer(...).train() in fields["output_dir"]: its training lines, grpo_config.json, and every line of its
    metrics.jsonl. What train() prints goes to stderr: stdout is the JSON line's."""
    cfg = grpo_ssr.GRPOConfig(**fields)
    trainer = grpo_ssr.GRPOTrainer(
        cfg,
        model=model,
        processing_class=tokenizer,
        train_dataset=grpo_ssr.builtin_prompts(),
        eval_dataset=eval_rows,
    )
    with contextlib.redirect_stdout(sys.stderr):
        history = trainer.train()
    out = Path(fields["output_dir"])
    record = json.loads((out / "grpo_config.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return history, record, rows


def summary(history: list[dict], record: dict) -> dict:
    """One run in the JSON line: its steps, last loss, counters, precision and buffer, and what failed in it."""
    last = history[-1] if history else {}
    return {
        "steps": len(history),
        "loss": last.get("loss"),
        "reward": last.get("reward"),
        "nonfinite_steps": last.get("nonfinite_steps"),
        "skipped_steps": last.get("skipped_steps"),
        "precision": record.get("precision"),
        "replay_buffer_class": record.get("replay_buffer_class"),
        "failures": step_failures(history),
    }


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class TimedGeneration:
    """Wraps grpo_ssr.generate_completions, which GRPOTrainer looks up in the module at each call: the seconds and
    completion tokens of each call, synchronised with the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls = []  # (seconds, completion tokens, completion positions)
        self.original = grpo_ssr.generate_completions

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, *args, **kwargs):
        self.sync()
        start = time.perf_counter()
        out = self.original(*args, **kwargs)
        self.sync()
        seconds = time.perf_counter() - start
        self.calls.append((seconds, int(out["completion_mask"].sum()), out["completion_ids"].numel()))
        return out

    def __enter__(self):
        grpo_ssr.generate_completions = self
        return self

    def __exit__(self, *exc):
        grpo_ssr.generate_completions = self.original


def benchmark(args, device: torch.device, shape: dict, folder: Path, result: dict):
    """The ssr run, timed; fills `result` with the measurement. Returns its training lines, grpo_config.json, the
    model (for the lean check) and what is wrong with the measurement."""
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    model, tokenizer = build(shape, device)
    result["build_s"] = round(time.perf_counter() - start, 2)
    result["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
    fields = qwen_fields(args, folder, args.replay_buffer_class, result["steps"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with TimedGeneration(device) as timer:
        history, record, _ = train_run(fields, model, tokenizer)
    if device.type == "cuda":
        result["peak_cuda_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        result["peak_cuda_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    measured = timer.calls[args.warmup :]
    seconds = sum(call[0] for call in measured)
    step_times = [row.get("step_time") for row in history[args.warmup :]]
    last = history[-1] if history else {}
    result.update(
        precision=record.get("precision"),
        logits_chunk_size=record.get("logits_chunk_size"),
        step_s=round(sum(step_times) / len(step_times), 4) if step_times and all(map(finite, step_times)) else None,
        gen_tokens_per_s=round(sum(call[1] for call in measured) / seconds, 1) if seconds else None,
        gen_s_per_call=round(seconds / len(measured), 4) if measured else None,
        gen_calls_measured=len(measured),
        completion_tokens_mean=mean_of(history[args.warmup :], "completion_length"),
        loss=last.get("loss"),
        nonfinite_steps=last.get("nonfinite_steps"),
        skipped_steps=last.get("skipped_steps"),
        reward_last=last.get("reward"),
    )
    problems = []
    if len(history) != result["steps"]:
        problems.append(f"{len(history)} training lines for {result['steps']} steps")
    if not measured:
        problems.append(f"the generation timer saw {len(timer.calls)} calls, none after the {args.warmup} warm-up ones")
    if result["step_s"] is None:
        problems.append(f"step_time missing or not finite after the warm-up: {step_times}")
    if device.type == "cuda" and not result["peak_cuda_allocated_gib"] > 0:
        problems.append(f"peak CUDA memory {result['peak_cuda_allocated_gib']} GiB: did the run use the GPU?")
    return history, record, model, problems


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [row.get(key) for row in rows]
    return round(sum(values) / len(values), 1) if values and all(map(finite, values)) else None


def qwen_fields(args, folder: Path, buffer: str, steps: int) -> dict:
    chunk = {} if args.logits_chunk_size is None else {"logits_chunk_size": args.logits_chunk_size}
    return dict(
        output_dir=str(folder / buffer),
        device=args.device,
        seed=args.seed,
        max_steps=steps,
        learning_rate=1e-6,
        per_device_train_batch_size=COMPLETIONS,
        num_generations=8,
        max_completion_length=args.max_completion_length,
        replay_buffer_class=buffer,
        eval_steps=0,
        **chunk,
    )


def tiny_fields(args, output_dir: Path, **more) -> dict:
    return dict(
        output_dir=str(output_dir),
        device=args.device,
        seed=args.seed,
        per_device_train_batch_size=COMPLETIONS,
        num_generations=8,
        replay_buffer_class="SSRReplayBuffer",
        **TINY,
        **more,
    )


def tiny_model(seed: int):
    torch.manual_seed(seed)
    return grpo_ssr.load_model("tiny")


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
    """The runs of one gpu_check and the checks on them: each check_* method returns its problems (empty: pass)."""

    def __init__(self, args, device: torch.device, shape: dict, folder: Path, result: dict):
        self.args, self.device, self.shape, self.folder, self.result = args, device, shape, folder, result
        self.checks = dict.fromkeys(CHECKS, "fail: not run")
        self.histories = {}  # run name -> its training lines
        self.records = {}  # run name -> its grpo_config.json
        self.runs = {}  # run name -> summary()
        self.lean = {}  # what the lean check measured
        self.model = None  # the benchmark's model, kept for the lean check
        self.tiny_rows = None  # every line of the tiny run's metrics.jsonl

    def attempt(self, name: str, check) -> None:
        """checks[name] from check()'s problems; an exception fails that check, on one line."""
        try:
            self.checks[name] = verdict(check())
        except Exception as error:  # a crash is a failed check, reported with the others
            self.checks[name] = f"fail: {describe(error)}"
            if self.args.traceback:
                traceback.print_exc()
        finally:
            free_memory(self.device)

    def keep(self, name: str, history: list[dict], record: dict) -> None:
        self.histories[name] = history
        self.records[name] = record
        self.runs[name] = summary(history, record)

    def check_benchmark(self) -> list[str]:
        history, record, self.model, problems = benchmark(self.args, self.device, self.shape, self.folder, self.result)
        self.keep("ssr", history, record)
        return problems

    def check_lean_logps(self) -> list[str]:
        precision = self.records.get("ssr", {}).get("precision")
        if precision not in LEAN_TOLERANCE or self.model is None:
            return [f"the ssr run left no model, or grpo_config.json's precision {precision!r} is not known here"]
        model, self.model = self.model, None
        return lean_check(model, self.device, precision, self.args.small, self.args.seed, self.lean)

    def check_buffers(self) -> list[str]:
        self.model = None
        free_memory(self.device)
        ours = self.args.replay_buffer_class
        other = BUFFERS[1] if ours == BUFFERS[0] else BUFFERS[0]
        torch.manual_seed(self.args.seed)
        model, tokenizer = build(self.shape, self.device)
        steps = 2 if self.args.small else 3
        history, record, _ = train_run(qwen_fields(self.args, self.folder, other, steps), model, tokenizer)
        self.keep("uniform", history, record)
        problems = []
        for name, buffer in (("ssr", ours), ("uniform", other)):
            if name not in self.runs:
                problems.append(f"{name} ({buffer}): did not finish")
                continue
            if self.records[name].get("replay_buffer_class") != buffer:
                problems.append(f"{name}: grpo_config.json says {self.records[name].get('replay_buffer_class')!r}")
            problems += [f"{name} ({buffer}) {p}" for p in self.runs[name]["failures"]]
        return problems

    def check_eos(self) -> list[str]:
        """The tiny run, which the eval and resume checks read too."""
        model, tokenizer = tiny_model(self.args.seed)
        fields = tiny_fields(self.args, self.folder / "tiny")
        history, record, self.tiny_rows = train_run(fields, model, tokenizer, grpo_ssr.builtin_prompts(heldout=True))
        self.keep("tiny", history, record)
        return eos_failures(history, TINY["max_completion_length"])

    def check_eval(self) -> list[str]:
        if self.tiny_rows is None:
            return ["the tiny run did not finish"]
        return eval_failures(self.tiny_rows, list(range(0, TINY["max_steps"] + 1, TINY["eval_steps"])))

    def check_resume(self) -> list[str]:
        if "tiny" not in self.histories:
            return ["the tiny run did not finish"]
        middle = TINY["save_steps"]
        checkpoint = self.folder / "tiny" / f"checkpoint-{middle}"
        model, tokenizer = tiny_model(self.args.seed)
        fields = tiny_fields(self.args, self.folder / "resumed", resume_from_checkpoint=str(checkpoint))
        history, record, _ = train_run(fields, model, tokenizer, grpo_ssr.builtin_prompts(heldout=True))
        self.keep("resumed", history, record)
        return resume_failures(self.histories["tiny"], history, middle, RESUME_TOLERANCE[self.device.type])

    def check_steps(self) -> list[str]:
        """Every run, after the others: each must have finished, every step trained with finite numbers."""
        problems = []
        for name in RUNS:
            if name not in self.runs:
                problems.append(f"{name}: did not finish")
            else:
                problems += [f"{name} {p}" for p in self.runs[name]["failures"]]
        return problems


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
        "replay_buffer_class": args.replay_buffer_class,
        "steps": steps,
        "warmup": args.warmup,
    }
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        session = Session(args, device, shape, Path(tmp), result)
        for name in ("benchmark", "lean_logps", "buffers", "eos", "eval", "resume", "steps"):  # in this order
            session.attempt(name, getattr(session, f"check_{name}"))
    checks = session.checks
    result.update(
        lean_logps=session.lean,
        resume_tolerance=RESUME_TOLERANCE[device.type],
        runs={name: {k: v for k, v in run.items() if k != "failures"} for name, run in session.runs.items()},
        checks=checks,
    )
    print(json.dumps(clean(result)))
    print_row(args, result)
    failed = [f"{name} ({why.removeprefix('fail: ')})" for name, why in checks.items() if why != "pass"]
    if failed:
        print(f"error: gpu_check: {len(failed)} of {len(checks)} checks failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


def print_row(args, result: dict) -> None:
    """The README-ready Markdown row of the measurement."""
    name = result["gpu"] or f"CPU ({h.machine()['cpu']})"
    size = "small dry-run model" if args.small else f"Qwen2-0.5B shape ({result.get('params_m')}M params, random)"
    peak = result.get("peak_cuda_allocated_gib")
    memory = f"{peak} GiB" if peak is not None else "n/a"
    passed = sum(v == "pass" for v in result["checks"].values())
    command = "python tests/benchmarks/gpu_check.py" + (" --device cpu --small" if args.small else "")
    columns = ["command", "date", "device", "model", "precision", "gen tokens/s", "s/step", "peak CUDA memory"]
    columns += ["checks", "torch", "transformers"]
    cells = [f"`{command}`", result["date"], name, size, result.get("precision"), result.get("gen_tokens_per_s")]
    cells += [result.get("step_s"), memory, f"{passed}/{len(result['checks'])} pass"]
    cells += [result["torch"], result["transformers"]]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the Hub
    os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars: stderr keeps the warnings and the verdict
    sys.exit(main())
