"""torch threads: one against two, on a quiet CPU and beside a competing CPU-bound process.

    python tests/benchmarks/bench_threads.py                      # the tiny default run: 20 steps, 2 repeats
    python tests/benchmarks/bench_threads.py --steps 6 --repeats 1
    python tests/benchmarks/bench_threads.py --recipe real --steps 6 --repeats 2             # bf16 where it can
    python tests/benchmarks/bench_threads.py --recipe real --precision float32 --steps 6 --repeats 2

`--recipe tiny` runs `python grpo_ssr.py` with its defaults (the tiny model, 16 completions of at most 64 tokens).
`--recipe real` runs the README's real-model quick start (SmolLM2-135M-Instruct on sums, 8 new tokens), with `--bf16`
unless `--precision float32`; its model must be in the preset cache (run the quick start once). Either way only
`--max_steps`, `--eval_steps 0` and `--num_threads` are added, and each run is a fresh process. "busy" starts one
`while True: pass` Python
process beside it for the run's whole length, as another job on a shared machine would be. The runs alternate
(1 thread, 2 threads; quiet, busy) so that a drift in the machine's load hits every cell alike. A cell's number is
the median over its runs of each run's median `step_time` (metrics.jsonl), the first step left out as a warm-up;
the whole run's wall time, imports included, is recorded too.

"quiet" means only that this script adds no load: whatever else runs on the machine is recorded as the load average
before each run (`load_before`) and should be read with the numbers. Writes tests/benchmarks/results/threads.json
(or --out) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


RECIPES = {
    "tiny": [],
    "real": [
        "--model",
        "smollm2-135m-instruct",
        "--dataset",
        "arithmetic",
        "--reward_funcs",
        "reward_accuracy",
        "--learning_rate",
        "2e-5",
        "--max_completion_length",
        "8",
        "--temperature",
        "0.7",
    ],
}


def one_run(threads: int, steps: int, busy: bool, recipe: list[str]) -> dict:
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as out:
            env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
            env.pop("OMP_NUM_THREADS", None)  # --num_threads alone decides
            start = time.perf_counter()
            proc = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "grpo_ssr.py"),
                    *recipe,
                    "--max_steps",
                    str(steps),
                    "--eval_steps",
                    "0",
                    "--num_threads",
                    str(threads),
                    "--output_dir",
                    out,
                ],
                capture_output=True,
                text=True,
                env=env,
            )
            wall = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-2000:])
            rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
            record = json.loads((Path(out) / "grpo_config.json").read_text())
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    times = [r["step_time"] for r in rows if "step_time" in r][1:]
    return {
        "threads": threads,
        "recorded_threads": record["num_threads"],
        "precision": record["precision"],
        "busy": busy,
        "median_step_s": statistics.median(times),
        "wall_s": wall,
        "load_before": load,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--recipe", choices=sorted(RECIPES), default="tiny")
    p.add_argument(
        "--precision",
        choices=["bf16", "float32"],
        default="bf16",
        help="--recipe real only: bf16 passes --bf16 (float32 where the CPU lacks bf16 instructions)",
    )
    p.add_argument("--out", help="default: results/threads.json (tiny), threads_real_<precision>.json (real)")
    p.add_argument("--note", default="", help="What else the machine was doing, recorded with the numbers.")
    args = p.parse_args(argv)
    recipe = RECIPES[args.recipe] + (["--bf16"] if args.recipe == "real" and args.precision == "bf16" else [])
    name = "threads.json" if args.recipe == "tiny" else f"threads_real_{args.precision}.json"
    args.out = args.out or str(Path(__file__).resolve().parent / "results" / name)
    runs = []
    for repeat in range(args.repeats):
        for busy in (False, True):
            for threads in (1, 2) if repeat % 2 == 0 else (2, 1):
                run = {"repeat": repeat, **one_run(threads, args.steps, busy, recipe)}
                runs.append(run)
                print(json.dumps(run), flush=True)
    table = {}
    for busy in (False, True):
        for threads in (1, 2):
            cell = [r for r in runs if r["busy"] == busy and r["threads"] == threads]
            table[f"{'busy' if busy else 'quiet'}, {threads} thread{'s' if threads > 1 else ''}"] = {
                "median_step_s": statistics.median(r["median_step_s"] for r in cell),
                "median_wall_s": statistics.median(r["wall_s"] for r in cell),
                "load_before": [round(r["load_before"], 2) for r in cell],
            }
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "recipe": ["grpo_ssr.py", *recipe],
        "steps": args.steps,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "machine": h.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "note": args.note,
        "table": table,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    width = max(map(len, table))
    print(f"\n{'':{width}}  s/step (median)  wall s (median)  load average before")
    for name, cell in table.items():
        print(f"{name:{width}}  {cell['median_step_s']:15.3f}  {cell['median_wall_s']:15.1f}  {cell['load_before']}")
    print(f"{args.steps} steps a run, {args.repeats} repeat(s); written to {args.out}")
    if args.note:
        print(f"note: {args.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
