"""Peak resident memory of grpo_ssr and of TRL's GRPOTrainer with a vocabulary of Qwen2's size.

    python tests/benchmarks/bench_memory.py                        # ~6 min: TRL, ours at 5 chunk sizes, idle baselines
    python tests/benchmarks/bench_memory.py --chunks 256,1024 --skip_idle
    python tests/benchmarks/bench_memory.py --candidate /tmp/perf  # also a patched grpo_ssr.py in that folder

Inputs: grpo_ssr's tiny Qwen2 (hidden 64, 2 layers, untied head) with build_tiny_tokenizer(extra_tokens=...) padded
to --vocab tokens (Qwen2's 151,936), so the embedding and head are 151,936 x 64 each (~39 M parameters, 0.16 GB
in fp32, 0.47 GB more for gradients and AdamW state). Everything else is as in bench_vs_trl.py: same model folder
and prompts for both, 16 completions of at most 256 tokens (8 per prompt), uniform buffer for ours, beta 0, bnpo,
fp32, no gradient checkpointing, --steps optimizer steps (default 2).

Completion lengths are reported: a random model over 152k tokens almost never samples EOS, so nearly every
completion runs to 256 tokens and both trainers score 16 x 256 = 4,096 completion tokens per step. Full fp32
logits for them would be 4,096 x 151,936 x 4 B = 2.5 GB.

Measurement: each run is its own process, and its peak resident set size is read from os.wait4's rusage
(ru_maxrss) in the parent: the kernel's high-water mark of the whole process, which also catches memory glibc keeps
after big temporary tensors are freed (FACTS.md). Every process gets the same environment (pass --env NAME=VALUE,
e.g. MALLOC_MMAP_THRESHOLD_=65536, to apply one to all runs alike). "idle" runs build each trainer and exit without
training: the memory of imports, model and data alone. grpo_ssr's --logits_chunk_size is swept (--chunks); the
target is ours <= 0.35 x TRL's peak. Runs alternate TRL / ours so that drifts hit both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

QWEN2_VOCAB = 151_936


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=QWEN2_VOCAB, help="tokenizer and model vocabulary size")
    p.add_argument("--max_completion_length", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    p.add_argument("--chunks", default="256,512,1024,2048,4096", help="grpo_ssr --logits_chunk_size values to sweep")
    p.add_argument(
        "--default_chunk",
        type=int,
        default=None,
        help="the chunk size compared with TRL (default: grpo_ssr's own default)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration; medians are quoted")
    p.add_argument("--ssr", action="store_true", help="also run ours with the SSR buffer (adds the old-logps pass)")
    p.add_argument("--candidate", default=None, metavar="DIR", help="also measure the grpo_ssr.py in DIR")
    p.add_argument("--skip_idle", action="store_true", help="skip the build-and-exit baselines")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="set for every run alike")
    p.add_argument("--out", default=None, help="raw results as JSON (default /tmp/grpo_ssr_bench/memory-TIME.json)")
    return p.parse_args()


def main() -> int:
    args = parse()
    import grpo_ssr

    default_chunk = args.default_chunk or grpo_ssr.GRPOConfig().logits_chunk_size
    chunks = sorted({int(c) for c in args.chunks.split(",")} | {default_chunk})
    env = dict(kv.split("=", 1) for kv in args.env)
    out = Path(args.out or f"/tmp/grpo_ssr_bench/memory-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "date": h.today(),
        "machine": h.machine(),
        "versions": h.versions(),
        "args": vars(args),
        "default_chunk": default_chunk,
        "grpo_ssr_file": grpo_ssr.__file__,
    }
    print(f"machine: {info['machine']}  versions: {info['versions']}  env: {env or 'inherited'}", flush=True)

    # (label, trainer, chunk, buffer, extra env, steps)
    plan = []
    if not args.skip_idle:
        plan += [("TRL idle", "trl", None, "ReplayBuffer", {}, 0), ("ours idle", "ours", None, "ReplayBuffer", {}, 0)]
    for c in chunks:  # TRL interleaved with ours' sweep
        if c == default_chunk:
            plan.append(("TRL", "trl", None, "ReplayBuffer", {}, args.steps))
        plan.append((f"ours chunk {c}", "ours", c, "ReplayBuffer", {}, args.steps))
    if args.ssr:
        plan.append((f"ours SSR chunk {default_chunk}", "ours", default_chunk, "SSRReplayBuffer", {}, args.steps))
    if args.candidate:
        plan.append(
            (
                f"candidate chunk {default_chunk}",
                "ours",
                default_chunk,
                "ReplayBuffer",
                {"PYTHONPATH": args.candidate},
                args.steps,
            )
        )

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmp:
        model_dir, data_path, vocab = h.prepare_inputs(Path(tmp), extra_tokens=args.vocab - 258)
        print(f"vocabulary {vocab:,}; {args.steps} steps of 16 completions of <= {args.max_completion_length} tokens")
        for r in range(args.repeats):
            for label, trainer, chunk, buffer, extra_env, steps in plan:
                spec = h.RunSpec(
                    trainer=trainer,
                    model_dir=model_dir,
                    data_path=data_path,
                    result_path=f"{tmp}/run.json",
                    max_steps=steps,
                    seed=r,
                    max_completion_length=args.max_completion_length,
                    replay_buffer_class=buffer,
                    logits_chunk_size=chunk,
                )
                raw = h.launch(spec, env={**env, **extra_env})
                rw = raw["rewards"]
                row = {
                    "label": label,
                    "repeat": r,
                    "peak_rss_mib": raw["peak_rss_mib"],
                    "wall_s": raw["wall_s"],
                    "tokens": statistics.fmean(x["tokens"] for x in rw) if rw else None,
                    "frac_max_length": statistics.fmean(x["frac_max_length"] for x in rw) if rw else None,
                    "s_per_step": (raw["step_ends"][-1] - raw["t_ready"]) / len(raw["step_ends"])
                    if raw["step_ends"]
                    else None,
                    "other_load": raw["other_load"],
                    "raw": raw,
                }
                runs.append(row)
                extra = (
                    ""
                    if not rw
                    else (
                        f", tokens/completion {row['tokens']:.1f}, "
                        f"{100 * row['frac_max_length']:.0f}% at the maximum, "
                        f"{row['s_per_step']:.1f} s/step incl. first"
                    )
                )
                print(
                    f"  {label:24s} peak RSS {row['peak_rss_mib']:7.0f} MiB  (wall {row['wall_s']:.0f} s{extra})",
                    flush=True,
                )

    def med(label):
        vals = [x["peak_rss_mib"] for x in runs if x["label"] == label]
        return h.median(vals) if vals else None

    trl_peak = med("TRL")
    ours_peak = med(f"ours chunk {default_chunk}")
    table = [(label, med(label)) for label in dict.fromkeys(x["label"] for x in runs)]
    summary = {
        "trl_peak_mib": trl_peak,
        "ours_peak_mib": ours_peak,
        "ratio": ours_peak / trl_peak,
        "target_ratio": 0.35,
        "peaks": dict(table),
        "best_chunk": min(chunks, key=lambda c: med(f"ours chunk {c}")),
    }
    out.write_text(json.dumps({**info, "summary": summary, "runs": runs}, indent=1))

    print(f"\npeak resident memory, median of {args.repeats} run(s) each:")
    print("| run | peak RSS (MiB) | / TRL |")
    print("|---|---|---|")
    for label, peak in table:
        print(f"| {label} | {peak:.0f} | {peak / trl_peak:.2f} |")
    verdict = "met" if summary["ratio"] <= 0.35 else "MISSED"
    print(
        f"\nours (chunk {default_chunk}) / TRL = {summary['ratio']:.2f} (target <= 0.35: {verdict}); lowest peak at "
        f"chunk {summary['best_chunk']}"
    )
    print(f"raw results: {out}\n")
    m = info["machine"]
    print("| command | date | machine | ours peak (GiB) | TRL 1.16 peak (GiB) | ours / TRL |")
    print("|---|---|---|---|---|---|")
    print(
        f"| `python tests/benchmarks/bench_memory.py` | {info['date']} | {m['nproc']} cores, {m['cpu']}, "
        f"{m['mem_gib']} GiB | {ours_peak / 1024:.2f} | {trl_peak / 1024:.2f} | {summary['ratio']:.2f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
