"""Held-out evaluation with one prefill per chunk of prompts, against the two it used to make, side by side.

    python tests/benchmarks/bench_eval.py    # the real-model recipe's evaluation, bf16 if the CPU can
    python tests/benchmarks/bench_eval.py --precision float32 --threads 1
    python tests/benchmarks/bench_eval.py --model tiny

`evaluate` scores each chunk of prompts greedily and by sampling. It used to call `generate_completions` twice, so
every prompt went through the model twice; it now calls `prefill` once and `decode`s a copy of that cache greedily
and the cache itself by sampling. "two prefills" below rebuilds the old way from `generate_completions` and
`score_generations`, under the same seed and random-stream handling, and the script checks that both ways score
every completion the same before it reports a time. The two alternate within each repeat, in one process.

The real model is the README's recipe: SmolLM2-135M-Instruct (from the preset cache: run the quick start once) on
the 60 held-out sums, 1 greedy and 2 sampled completions each at T = 0.7, at most 8 tokens, `reward_accuracy`. The
tiny model: the built-in held-out posts, 4 sampled, 64 tokens, `reward_len`. Writes
tests/benchmarks/results/eval_<model>_<precision>.json (or --out) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import _harness as h  # noqa: E402
import grpo_ssr as g  # noqa: E402

SETTINGS = {
    "real": dict(
        model="smollm2-135m-instruct",
        dataset="arithmetic",
        reward="reward_accuracy",
        num_generations=2,
        max_completion_length=8,
        temperature=0.7,
    ),
    "tiny": dict(
        model="tiny",
        dataset="builtin",
        reward="reward_len",
        num_generations=4,
        max_completion_length=64,
        temperature=1.0,
    ),
}


def two_prefills(
    model, tok, rows, funcs, *, num_generations, temperature, max_completion_length, seed, autocast, batch_prompts=32
):
    """evaluate() as it was before the shared prefill: each mode's own generate_completions call. Rewards per mode."""
    scores = {"greedy": [], "sampled": []}
    model.eval()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for s in range(0, len(rows), batch_prompts):
            chunk = rows[s : s + batch_prompts]
            for mode, n in (("greedy", 1), ("sampled", num_generations)):
                with autocast():
                    batch = g.generate_completions(
                        model,
                        tok,
                        g.prompt_texts(chunk, tok),
                        n,
                        512,
                        max_completion_length,
                        temperature,
                        greedy=mode == "greedy",
                    )
                scores[mode].append(g.score_generations(batch, chunk, n, tok, funcs, [1.0] * len(funcs))[0])
    return {mode: torch.cat(v) for mode, v in scores.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(SETTINGS), default="real")
    p.add_argument(
        "--precision",
        choices=["bf16", "float32"],
        default="bf16",
        help="bf16 autocast where the CPU has bf16 instructions, else float32 with a warning",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    s = SETTINGS[args.model]
    device, autocast = g.pick_device("cpu", args.precision == "bf16", args.threads)
    g.set_seed(0)
    model, tok = g.load_model(s["model"])
    model.to(device)
    rows = (
        g.arithmetic_prompts([1, 2], heldout=True) if s["dataset"] == "arithmetic" else g.builtin_prompts(heldout=True)
    )[:64]
    funcs = [getattr(g, s["reward"])]
    kw = dict(
        num_generations=s["num_generations"],
        temperature=s["temperature"],
        max_completion_length=s["max_completion_length"],
        seed=0,
        autocast=autocast,
    )
    times = {"one prefill (evaluate)": [], "two prefills": []}
    for r in range(args.repeats):
        order = list(times) if r % 2 == 0 else list(times)[::-1]
        for name in order:
            start = time.perf_counter()
            if name == "two prefills":
                old = two_prefills(model, tok, rows, funcs, **kw)
            else:
                new = g.evaluate(model, tok, rows, funcs, **kw)
            times[name].append(time.perf_counter() - start)
    same = (
        new["eval_reward"] == old["sampled"].mean().item() and new["eval_greedy_reward"] == old["greedy"].mean().item()
    )
    if not same:
        print(f"the two ways score differently: {new} against {old}", file=sys.stderr)
        return 1
    table = {name: statistics.median(t) for name, t in times.items()}
    precision = "bf16 autocast" if autocast is not g.nullcontext else "float32"
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": h.today(),
        "machine": h.machine(),
        "versions": h.versions(),
        "settings": s,
        "prompts": len(rows),
        "threads": torch.get_num_threads(),
        "precision": precision,
        "eval_reward": new["eval_reward"],
        "eval_greedy_reward": new["eval_greedy_reward"],
        "same_scores": same,
        "median_s": table,
        "runs_s": times,
        "ratio": table["one prefill (evaluate)"] / table["two prefills"],
    }
    out = Path(
        args.out or Path(__file__).resolve().parent / "results" / f"eval_{args.model}_{precision.split()[0]}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{len(rows)} prompts, {precision}, {torch.get_num_threads()} thread(s); identical scores "
        f"(sampled {new['eval_reward']:.3f}, greedy {new['eval_greedy_reward']:.3f})"
    )
    for name, t in table.items():
        print(f"{name:24}  {t:6.2f} s (median of {args.repeats})")
    print(f"ratio {result['ratio']:.2f}; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
