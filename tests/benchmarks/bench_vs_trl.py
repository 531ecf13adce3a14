"""grpo_ssr against TRL's GRPOTrainer on identical inputs: steady-state seconds per step, and the reward reached.

    python tests/benchmarks/bench_vs_trl.py                 # 3 repeats of each, N = 20, 200-step runs (~4 min)
    python tests/benchmarks/bench_vs_trl.py --repeats 5 --out /tmp/vs_trl.json

Identical inputs. One tiny random Qwen2 (grpo_ssr.build_tiny_tokenizer + build_tiny_model, torch seed 0) is saved
with save_pretrained to a temporary folder and grpo_ssr.builtin_prompts to a .jsonl file; both trainers load both.
Both: 16 completions a step, 8 per prompt, at most 64 new tokens, temperature 1.0 with top-k and top-p off (TRL 1.16
passes top_k=0, top_p=1.0 to generate; the worker records TRL's resolved GenerationConfig to prove it), beta 0,
learning rate 1e-3 decayed linearly to 0, AdamW without weight decay, gradient clipping at 1.0, loss_type bnpo,
rewards scaled by the group std, epsilon 0.2, one optimizer step per generation batch, reward grpo_ssr.reward_len
(-|20 - characters|). Each samples with its own code: TRL through transformers' `generate`, ours through
grpo_ssr.generate_completions (a decode loop with one prefill per prompt); that difference is part of what is
timed. Ours uses the uniform buffer (--replay_buffer_class ReplayBuffer): plain GRPO. TRL: no vLLM,
report_to "none", CPU, no checkpoints; its defaults of bf16 autocast and gradient checkpointing are switched off,
because ours runs plain fp32 on CPU and neither trainer should be timed doing different arithmetic. Logging as
each does by default: ours writes a metrics.jsonl line every step and a progress bar; TRL logs every 10 steps
(its default logging_steps), progress bar off. Mean completion lengths in the timed window are printed, since
generation stops when the longest completion of the batch ends and the two trainers sample different completions.

Timing method. Each run is its own Python process (memory and time isolated, nothing cached between runs), and
the runs alternate ours / TRL / ours / TRL ... for --repeats rounds, so slow drifts of the machine hit both alike.
Inside a run, the end of every optimizer step is timestamped (a subclass of our trainer; a TrainerCallback's
on_step_end for TRL), and the steady-state cost is

    (time at the end of step 3N - time at the end of step N) / 2N,

the same as "time a 3N-step run minus time an N-step run, over 2N", but with one process instead of two, so
start-up (imports, model loading, the first slow steps) cancels exactly and no run-to-run noise is added. We quote
the median over the repeats and the ratio of the medians, ours / TRL (target <= 0.8).

Reward. The same runs continue to --steps steps (default 200). The "reward reached" is the mean reward of the last
--reward_last generation batches (default 20), recorded by a wrapper around grpo_ssr.reward_len given to both
trainers; repeat r uses seed r for both, so the median is over seeds. The reward of the first batches is shown too.

Machine load. On 2 cores a second busy process slows torch far more than its share (seen here: an order of
magnitude, hitting one trainer or the other at random), so before each run the benchmark waits (up to 15 min)
until other processes use under 0.2 cores, records the CPU time they took while the run ran (/proc/stat), and
reruns a run they disturbed by more than 0.1 cores on average (--retries, default twice; a run still disturbed is
kept and flagged).
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


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="rounds of (ours, TRL); medians are over these")
    p.add_argument("--n", type=int, default=20, help="N: steady state is measured from step N to step 3N")
    p.add_argument("--steps", type=int, default=200, help="steps per run (at least 3N); the reward is read at the end")
    p.add_argument("--reward_last", type=int, default=20, help="reward reached = mean over this many last batches")
    p.add_argument("--max_completion_length", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r for both trainers")
    p.add_argument("--out", default=None, help="raw results as JSON (default /tmp/grpo_ssr_bench/vs_trl-TIME.json)")
    p.add_argument(
        "--candidate",
        default=None,
        metavar="DIR",
        help="also time the grpo_ssr.py in DIR (e.g. a patched copy), in the same rounds, as 'candidate'",
    )
    p.add_argument("--retries", type=int, default=2, help="reruns of a run other processes disturbed")
    p.add_argument("--verbose", action="store_true", help="show the workers' stdout")
    return p.parse_args()


def summarise(result: dict, n: int, reward_last: int) -> dict:
    ends, rewards = result["step_ends"], result["rewards"]
    window = [r["tokens"] for r in rewards[n : 3 * n] if "tokens" in r]
    return {
        "s_per_step": h.steady_seconds_per_step(ends, n),
        "reward_first": statistics.fmean(r["reward"] for r in rewards[:reward_last]),
        "reward_last": statistics.fmean(r["reward"] for r in rewards[-reward_last:]),
        "tokens_timed_window": statistics.fmean(window) if window else None,
        "tokens_last": statistics.fmean(r["tokens"] for r in rewards[-reward_last:]),
        "wall_s": result["wall_s"],
        "peak_rss_mib": result["peak_rss_mib"],
        "other_load": result["other_load"],
    }


def main() -> int:
    args = parse()
    steps = max(args.steps, 3 * args.n)
    out = Path(args.out or f"/tmp/grpo_ssr_bench/vs_trl-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"date": h.today(), "machine": h.machine(), "versions": h.versions(), "args": vars(args), "steps": steps}
    print(f"machine: {info['machine']}  versions: {info['versions']}", flush=True)
    runs: list[dict] = []
    contenders = ("ours", "trl") + (("candidate",) if args.candidate else ())
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl-") as tmp:
        model_dir, data_path, vocab = h.prepare_inputs(Path(tmp))
        for r in range(args.repeats):
            for trainer in contenders:
                spec = h.RunSpec(
                    trainer="trl" if trainer == "trl" else "ours",
                    model_dir=model_dir,
                    data_path=data_path,
                    result_path=f"{tmp}/{trainer}-{r}.json",
                    max_steps=steps,
                    seed=args.seed + r,
                    max_completion_length=args.max_completion_length,
                )
                env = {"PYTHONPATH": args.candidate} if trainer == "candidate" else None
                raw = h.launch_quiet(spec, env=env, quiet=not args.verbose, retries=args.retries)
                s = summarise(raw, args.n, args.reward_last)
                flag = "  <-- machine busy, rerun" if s["other_load"] > 0.1 else ""
                print(
                    f"repeat {r} {trainer:9s}: {s['s_per_step']:.4f} s/step, reward {s['reward_first']:6.1f} -> "
                    f"{s['reward_last']:6.1f}, tokens {s['tokens_timed_window']:.1f} (timed) -> "
                    f"{s['tokens_last']:.1f}, wall {s['wall_s']:.0f} s, peak RSS {s['peak_rss_mib']:.0f} MiB, "
                    f"other load {s['other_load']:.2f} cores{flag}",
                    flush=True,
                )
                runs.append({"repeat": r, "trainer": trainer, "summary": s, "raw": raw})

    def med(trainer, key):
        return h.median([x["summary"][key] for x in runs if x["trainer"] == trainer])

    ours, trl = med("ours", "s_per_step"), med("trl", "s_per_step")
    ratio = ours / trl
    summary = {
        "ours_s_per_step": ours,
        "trl_s_per_step": trl,
        "ratio": ratio,
        "target_ratio": 0.8,
        "ours_reward_last": med("ours", "reward_last"),
        "trl_reward_last": med("trl", "reward_last"),
        "ours_reward_first": med("ours", "reward_first"),
        "trl_reward_first": med("trl", "reward_first"),
        "ours_peak_rss_mib": med("ours", "peak_rss_mib"),
        "trl_peak_rss_mib": med("trl", "peak_rss_mib"),
        "trl_sampling": runs[1]["raw"].get("trl_sampling"),
        "busy_runs": sum(x["summary"]["other_load"] > 0.1 for x in runs),
    }
    if args.candidate:
        cand = med("candidate", "s_per_step")
        summary.update(
            candidate_path=args.candidate,
            candidate_s_per_step=cand,
            candidate_ratio=cand / trl,
            candidate_reward_last=med("candidate", "reward_last"),
        )
    out.write_text(json.dumps({**info, "summary": summary, "runs": runs}, indent=1))

    m = info["machine"]
    machine = f"{m['nproc']} cores, {m['cpu']}, {m['mem_gib']} GiB"
    print(f"\nmedians over {args.repeats} repeats, steady state from step {args.n} to {3 * args.n}:")
    print(
        f"  ours {ours:.4f} s/step   TRL {trl:.4f} s/step   ratio ours/TRL {ratio:.2f} (target <= 0.8: "
        f"{'met' if ratio <= 0.8 else 'MISSED'})"
    )
    print(
        f"  reward, mean of the last {args.reward_last} of {steps} steps: ours {summary['ours_reward_last']:.1f}, "
        f"TRL {summary['trl_reward_last']:.1f} (first {args.reward_last}: ours {summary['ours_reward_first']:.1f}, "
        f"TRL {summary['trl_reward_first']:.1f})"
    )
    if args.candidate:
        print(
            f"  candidate ({args.candidate}): {cand:.4f} s/step, ratio candidate/TRL {cand / trl:.2f}, "
            f"candidate/ours {cand / ours:.2f}, reward {summary['candidate_reward_last']:.1f}"
        )
    if summary["busy_runs"]:
        print(f"  WARNING: {summary['busy_runs']} run(s) shared the CPU with other processes; rerun on a quiet machine")
    print(f"  raw results: {out}\n")
    command = "python tests/benchmarks/bench_vs_trl.py" + "".join(
        f" --{k} {v}"
        for k, v in vars(args).items()
        if k not in ("out", "verbose", "candidate", "retries") and v != parse_defaults().get(k)
    )
    print("| command | date | machine | ours (s/step) | TRL 1.16 (s/step) | ours / TRL |")
    print("|---|---|---|---|---|---|")
    print(f"| `{command}` | {info['date']} | {machine} | {ours:.3f} | {trl:.3f} | {ratio:.2f} |")
    return 0


def parse_defaults() -> dict:
    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        return vars(parse())
    finally:
        sys.argv = saved


if __name__ == "__main__":
    sys.exit(main())
