"""The CPU recipe: SmolLM2-135M-Instruct learns sums, measured on held-out questions, over several seeds.

    python tests/benchmarks/recipe_cpu.py                       # seeds 0 1 2, one after the other
    python tests/benchmarks/recipe_cpu.py --seeds 0 --set max_steps=10 --out /tmp/recipe   # a quick try

Each seed runs `grpo_ssr.run` with RECIPE (the same settings as the README's command) in its own output folder, and
the run's own evaluations give the held-out numbers: the line at step 0 (before any update) and the one at the last
step. The held-out questions are the same for every seed (the split is fixed); each evaluation samples with the
run's seed, the same draw before and after, so the difference is the model's. Wall time is the whole run: loading
the model, both evaluations, training and saving.

Writes one JSON file per seed (the config, every metrics line, the wall time) and summary.json under --out
(default tests/benchmarks/results/recipe_cpu/), and prints a table. Torch uses --threads threads (2 by default: the
2-core laptop the recipe is written for). Timings depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
import grpo_ssr  # noqa: E402

RECIPE = dict(
    model="smollm2-135m-instruct",
    dataset="arithmetic",
    reward_funcs="reward_accuracy",
    learning_rate=2e-5,
    per_device_train_batch_size=16,
    num_generations=8,
    max_completion_length=8,
    temperature=0.7,
    max_steps=40,
    eval_steps=40,
    eval_num_generations=2,
    bf16=True,
    device="cpu",
    replay_buffer_class="SSRReplayBuffer",
)  # what results/ was measured with, the default buffer then
KEYS = ("eval_greedy_accuracy", "eval_accuracy")


def parse_overrides(items: list[str]) -> dict:
    types = {f.name: f.type for f in dataclasses.fields(grpo_ssr.GRPOConfig)}
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true")}.get(
            str(types.get(key)), str
        )(value)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override RECIPE fields")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO_ROOT / "tests" / "benchmarks" / "results" / "recipe_cpu"))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    recipe = {**RECIPE, **parse_overrides(args.set)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grpo_ssr.load_model(recipe["model"])  # convert once, outside the timed runs
    per_seed = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = grpo_ssr.GRPOConfig(**recipe, seed=seed, output_dir=run_dir)
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                grpo_ssr.run(cfg)
            wall = time.perf_counter() - start
            train, evals = grpo_ssr.read_metrics(Path(run_dir) / "metrics.jsonl")
        result = {
            "seed": seed,
            "wall_s": round(wall, 1),
            "config": dataclasses.asdict(cfg),
            "before": {k: evals[0][k] for k in KEYS},
            "after": {k: evals[-1][k] for k in KEYS},
            "train_reward_first5": statistics.mean(r["reward"] for r in train[:5]),
            "train_reward_last5": statistics.mean(r["reward"] for r in train[-5:]),
            "frac_reward_zero_std": statistics.mean(r["frac_reward_zero_std"] for r in train),
            "metrics": train,
            "evals": evals,
        }
        (out / f"seed{seed}.json").write_text(json.dumps(result) + "\n")
        per_seed.append(result)
        print(
            f"seed {seed}: held-out greedy accuracy {result['before']['eval_greedy_accuracy']:.3f} -> "
            f"{result['after']['eval_greedy_accuracy']:.3f}, sampled {result['before']['eval_accuracy']:.3f} -> "
            f"{result['after']['eval_accuracy']:.3f}; training reward {result['train_reward_first5']:.3f} -> "
            f"{result['train_reward_last5']:.3f}; {wall:.0f} s",
            flush=True,
        )
    mean = lambda when, key: round(statistics.mean(r[when][key] for r in per_seed), 4)
    summary = {
        "recipe": recipe,
        "seeds": args.seeds,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "before": {k: mean("before", k) for k in KEYS},
        "after": {k: mean("after", k) for k in KEYS},
        "wall_s": [r["wall_s"] for r in per_seed],
        "per_seed": [{k: r[k] for k in ("seed", "wall_s", "before", "after")} for r in per_seed],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"mean over {len(per_seed)} seeds: greedy {summary['before']['eval_greedy_accuracy']:.3f} -> "
        f"{summary['after']['eval_greedy_accuracy']:.3f}, sampled {summary['before']['eval_accuracy']:.3f} -> "
        f"{summary['after']['eval_accuracy']:.3f}; wall {min(summary['wall_s']):.0f}-{max(summary['wall_s']):.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
