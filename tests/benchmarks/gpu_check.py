"""GPU check: a few grpo_ssr steps of a random model with Qwen2-0.5B-Instruct's shape, on one CUDA device.

    python tests/benchmarks/gpu_check.py                     # on a GPU machine: a few minutes on one H200
    python tests/benchmarks/gpu_check.py --device cpu --small  # dry run of the same code path on CPU (~30 s)

Nothing is downloaded. The model is Qwen2ForCausalLM built in code from Qwen2-0.5B-Instruct's configuration (hidden
896, MLP 4864, 24 layers, 14 attention heads, 2 key/value heads, vocabulary 151,936, tied embeddings, rope theta
1e6, 32,768 positions; checked against the published config.json) with random weights, and the tokenizer is
grpo_ssr.build_tiny_tokenizer padded with dummy tokens to the same vocabulary. A random model over 152k tokens
almost never samples EOS, so completions run to max_completion_length: a fixed, known amount of work.

It runs grpo_ssr.GRPOTrainer as a user would on a GPU (SSR buffer by default, 16 completions a step, 8 per prompt,
256 new tokens, bf16 autocast where the GPU supports it, fp32 weights and AdamW) and prints, as one JSON line and a
README-ready markdown row:
- generation tokens/s: completion tokens produced (up to and including EOS) / seconds inside generate_completions,
  over the measured steps;
- steady-state seconds per step: (end of the last step - end of step --warmup) / (steps - warmup);
- peak CUDA memory (torch.cuda.max_memory_allocated, and reserved), GPU name, torch and transformers versions.
Without CUDA (and without --device cpu) it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402,F401  (puts the repository root on sys.path)
import grpo_ssr  # noqa: E402

QWEN2_0_5B_INSTRUCT = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
                           rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           hidden_act="silu", use_sliding_window=False)
SMALL = dict(QWEN2_0_5B_INSTRUCT, vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (skips with exit 0 when there is none) or cpu for a dry run")
    p.add_argument("--small", action="store_true",
                   help="2 layers, hidden 64, vocabulary 8,192, 32 new tokens: a fast dry run of the same path")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 6; 4 with --small)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the steady-state time")
    p.add_argument("--max_completion_length", type=int, default=None, help="default 256; 32 with --small")
    p.add_argument("--replay_buffer_class", default="SSRReplayBuffer")
    p.add_argument("--logits_chunk_size", type=int, default=None, help="default: grpo_ssr's default")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build(model_kwargs: dict, device: torch.device):
    """Tokenizer padded to the vocabulary, and a random Qwen2 built directly on the device."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = grpo_ssr.build_tiny_tokenizer(extra_tokens=model_kwargs["vocab_size"] - 258)
    assert len(tokenizer) == model_kwargs["vocab_size"], (len(tokenizer), model_kwargs["vocab_size"])
    config = Qwen2Config(**model_kwargs, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    with device:
        model = Qwen2ForCausalLM(config)
    # As grpo_ssr.load_model does: plain sampling, no generation defaults carried in.
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model, tokenizer


def main() -> int:
    args = parse()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (use --device cpu --small for a dry run)")
        return 0
    device = torch.device(args.device)
    shape = SMALL if args.small else QWEN2_0_5B_INSTRUCT
    steps = args.steps or (4 if args.small else 6)
    completion = args.max_completion_length or (32 if args.small else 256)
    if steps <= args.warmup:
        sys.exit(f"gpu_check: --steps ({steps}) must exceed --warmup ({args.warmup})")

    torch.manual_seed(args.seed)
    t_build = time.perf_counter()
    model, tokenizer = build(shape, device)
    n_params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - t_build

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    gen = {"seconds": 0.0, "tokens": 0, "positions": 0, "calls": 0, "measure": False}
    original_generate = grpo_ssr.generate_completions

    def timed_generate(*a, **k):  # GRPOTrainer looks the function up in the module at each call
        sync()
        start = time.perf_counter()
        out = original_generate(*a, **k)
        sync()
        if gen["measure"]:
            gen["seconds"] += time.perf_counter() - start
            gen["tokens"] += int(out["completion_mask"].sum())
            gen["positions"] += out["completion_ids"].numel()
            gen["calls"] += 1
        return out

    chunk = {} if args.logits_chunk_size is None else {"logits_chunk_size": args.logits_chunk_size}
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as out_dir:
        cfg = grpo_ssr.GRPOConfig(model="in-memory", output_dir=out_dir, device=args.device, seed=args.seed,
                                  max_steps=steps, learning_rate=1e-6, per_device_train_batch_size=16,
                                  num_generations=8, max_completion_length=completion,
                                  replay_buffer_class=args.replay_buffer_class, **chunk)
        trainer = grpo_ssr.GRPOTrainer(cfg, model=model, processing_class=tokenizer,
                                       train_dataset=grpo_ssr.builtin_prompts())
        grpo_ssr.generate_completions = timed_generate
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ends, history = [], []
        try:
            for i in range(steps):
                gen["measure"] = i >= args.warmup
                history.append(trainer.train_step())
                sync()
                ends.append(time.perf_counter())
        finally:
            grpo_ssr.generate_completions = original_generate

    measured = steps - args.warmup
    result = {
        "check": "gpu_check", "date": h.today(), "small": args.small, "device": args.device,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "bf16_autocast": device.type == "cuda" and torch.cuda.is_bf16_supported(),
        "torch": torch.__version__, "transformers": h.versions()["transformers"],
        "params_m": round(n_params / 1e6, 1), "vocab": shape["vocab_size"], "layers": shape["num_hidden_layers"],
        "hidden": shape["hidden_size"], "completions_per_step": 16, "max_completion_length": completion,
        "replay_buffer_class": args.replay_buffer_class, "logits_chunk_size": trainer.cfg.logits_chunk_size,
        "steps": steps, "warmup": args.warmup, "build_s": round(build_s, 2),
        "step_s": round((ends[-1] - ends[args.warmup - 1]) / measured, 4) if args.warmup else
        round((ends[-1] - ends[0]) / max(1, steps - 1), 4),
        "gen_tokens_per_s": round(gen["tokens"] / gen["seconds"], 1) if gen["seconds"] else None,
        "gen_s_per_call": round(gen["seconds"] / gen["calls"], 4) if gen["calls"] else None,
        "gen_calls_measured": gen["calls"],
        "completion_tokens_mean": round(sum(m.get("completion_length", 0) for m in history[args.warmup:])
                                        / measured, 1),
        "peak_cuda_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda" else None,
        "peak_cuda_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        if device.type == "cuda" else None,
        "reward_last": history[-1].get("reward"), "skipped_steps": history[-1].get("skipped_steps"),
    }
    print(json.dumps(result))
    name = result["gpu"] or f"CPU ({h.machine()['cpu']})"
    size = "small dry-run model" if args.small else f"Qwen2-0.5B shape ({result['params_m']}M params, random)"
    mem = f"{result['peak_cuda_allocated_gib']} GiB" if result["peak_cuda_allocated_gib"] is not None else "n/a"
    print("| command | date | device | model | gen tokens/s | s/step | peak CUDA memory | torch | transformers |")
    print("|---|---|---|---|---|---|---|---|---|")
    command = "python tests/benchmarks/gpu_check.py" + (" --device cpu --small" if args.small else "")
    print(f"| `{command}` | {result['date']} | {name} | {size} | {result['gen_tokens_per_s']} | {result['step_s']} | "
          f"{mem} | {result['torch']} | {result['transformers']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
