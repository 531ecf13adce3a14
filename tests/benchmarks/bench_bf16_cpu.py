"""bf16 autocast against float32 on this CPU: seconds per training step of the CPU recipe, side by side.

    python tests/benchmarks/bench_bf16_cpu.py                 # 3 timed steps of each, alternating, 2 repeats
    python tests/benchmarks/bench_bf16_cpu.py --steps 2 --repeats 1 --threads 1

`--bf16` pays only on CPUs that compute in bf16 natively (AVX512-BF16 or AMX); elsewhere torch emulates it, and
grpo_ssr warns and stays in float32 (`cpu_has_bf16`). This script measures both on whatever CPU runs it, bf16 forced
on even where grpo_ssr would not use it, so the README's claim can be checked anywhere. Settings: the recipe's
(tests/benchmarks/recipe_cpu.py: SmolLM2-135M-Instruct, 16 completions of at most 8 tokens, T = 0.7), SSR off (the
uniform buffer, so every step trains one fresh batch) and no evaluation. Each repeat builds a trainer per mode, runs one
untimed warm-up step, then --steps timed ones (generation, scoring and the update: the trainer's own step_time).

Writes tests/benchmarks/results/bf16_cpu.json (or --out) and prints the medians. Time depends on what else the
machine is doing; the JSON records the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_cpu import RECIPE  # noqa: E402

import _harness as h  # noqa: E402  (puts the repository root on sys.path)
import grpo_ssr  # noqa: E402


def step_times(bf16: bool, steps: int, seed: int) -> list[float]:
    import torch

    with tempfile.TemporaryDirectory() as out:
        settings = {**RECIPE, "bf16": False, "eval_steps": 0, "replay_buffer_class": "ReplayBuffer"}
        trainer = grpo_ssr.GRPOTrainer(grpo_ssr.GRPOConfig(**settings, seed=seed, output_dir=out))
        if bf16:  # forced, whatever cpu_has_bf16 says: this is what an emulated bf16 would cost
            trainer.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
        trainer.train_step()  # warm-up: first-call allocations and kernel choices
        return [trainer.train_step()["step_time"] for _ in range(steps)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "bf16_cpu.json"))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    grpo_ssr.load_model(RECIPE["model"])  # convert once, outside the timed steps
    times = {"float32": [], "bf16": []}
    for repeat in range(args.repeats):  # alternate, so that a drift in machine load hits both modes
        for mode in ("float32", "bf16"):
            times[mode] += step_times(mode == "bf16", args.steps, seed=repeat)
            print(f"repeat {repeat} {mode}: {times[mode][-args.steps :]}", flush=True)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    result = {
        "date": h.today(),
        "machine": h.machine(),
        "versions": h.versions(),
        "threads": args.threads,
        "cpu_has_bf16": grpo_ssr.cpu_has_bf16(),
        "settings": {**RECIPE, "eval_steps": 0},
        "step_time_s": times,
        "median_s": median,
        "bf16_over_float32": median["bf16"] / median["float32"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"cpu_has_bf16 {result['cpu_has_bf16']}: median s/step float32 {median['float32']:.2f}, "
        f"bf16 {median['bf16']:.2f} (x{result['bf16_over_float32']:.2f}); wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
