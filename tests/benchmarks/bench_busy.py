"""A run beside one busy process against the same run on a quiet CPU, with OpenMP's idle threads sleeping (what
grpo_ssr.py sets unless you set OMP_WAIT_POLICY) and spinning (libgomp's own default, as before).

    python tests/benchmarks/bench_busy.py --recipe real --steps 6 --repeats 2   # the SmolLM2 sums recipe
    python tests/benchmarks/bench_busy.py --recipe tiny --steps 20 --repeats 2  # python grpo_ssr.py

Each run is `python grpo_ssr.py` as a user types it (torch's thread count left to the file's default: one for the tiny
model, one per core for a real one), plus `--max_steps`, `--eval_steps 0` and the recipe's bf16 (float32 where the CPU
lacks bf16 instructions). "busy" starts one `while True: pass` process beside it for the run's whole length, as another
job on a shared machine would be. "spin" sets GOMP_SPINCOUNT=300000, the spin count libgomp uses when no wait policy
is set (which is what ran before grpo_ssr.py set OMP_WAIT_POLICY=PASSIVE); "sleep" leaves the environment alone. The
four cells alternate within each repeat. A cell is the median over its runs of each run's median `step_time`, the first
step left out as a warm-up. The targets: busy at most 2.0x quiet for the real recipe (losing one of two cores costs
2x), at most 1.6x for the tiny one (one thread, so the busy process takes the other core). Writes
tests/benchmarks/results/busy_<recipe>.json (or --out) and prints the table.
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
from bench_threads import RECIPES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WAITS = {"sleep": {}, "spin": {"GOMP_SPINCOUNT": "300000"}}


def one_run(recipe: list[str], steps: int, wait: str, busy: bool) -> dict:
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as out:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
            env.update(WAITS[wait], TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
            args = [*recipe, "--max_steps", str(steps), "--eval_steps", "0", "--output_dir", out]
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, str(ROOT / "grpo_ssr.py"), *args], capture_output=True, text=True, env=env
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
        "wait": wait,
        "busy": busy,
        "threads": record["num_threads"],
        "precision": record["precision"],
        "median_step_s": statistics.median(times),
        "wall_s": wall,
        "load_before": load,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", choices=sorted(RECIPES), default="real")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", help="default: results/busy_<recipe>.json")
    args = p.parse_args(argv)
    recipe = RECIPES[args.recipe] + (["--bf16"] if args.recipe == "real" else [])
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"busy_{args.recipe}.json")
    cells = [(wait, busy) for wait in WAITS for busy in (False, True)]
    runs = []
    for repeat in range(args.repeats):
        for wait, busy in cells if repeat % 2 == 0 else cells[::-1]:
            runs.append({"repeat": repeat, **one_run(recipe, args.steps, wait, busy)})
            print(json.dumps(runs[-1]), flush=True)
    table = {}
    for wait, busy in cells:
        cell = [r for r in runs if r["wait"] == wait and r["busy"] == busy]
        table[f"{wait}, {'busy' if busy else 'quiet'}"] = statistics.median(r["median_step_s"] for r in cell)
    ratios = {wait: table[f"{wait}, busy"] / table[f"{wait}, quiet"] for wait in WAITS}
    result = {
        "command": " ".join(["bench_busy.py", *(argv if argv is not None else sys.argv[1:])]),
        "recipe": ["grpo_ssr.py", *recipe],
        "steps": args.steps,
        "repeats": args.repeats,
        "machine": h.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "median_step_s": table,
        "busy_over_quiet": ratios,
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, seconds in table.items():
        print(f"{name:12s} {seconds:8.3f} s/step (median)")
    print(
        "busy / quiet: " + ", ".join(f"{wait} {ratio:.2f}x" for wait, ratio in ratios.items()) + f"; written to {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
