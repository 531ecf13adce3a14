"""torch threads for the default tiny run: one against two, on a quiet CPU and beside a competing CPU-bound process.

    python tests/benchmarks/bench_threads.py                      # 20 steps of each, 2 alternating repeats
    python tests/benchmarks/bench_threads.py --steps 6 --repeats 1

Each run is `python grpo_ssr.py` with its defaults (the tiny model, 16 completions of at most 64 tokens) but
`--max_steps`, `--eval_steps 0` and `--num_threads`, in a fresh process. "busy" starts one `while True: pass` Python
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
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one_run(threads: int, steps: int, busy: bool) -> dict:
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as out:
            env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
            env.pop("OMP_NUM_THREADS", None)  # --num_threads alone decides
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, str(ROOT / "grpo_ssr.py"), "--max_steps", str(steps),
                                   "--eval_steps", "0", "--num_threads", str(threads), "--output_dir", out],
                                  capture_output=True, text=True, env=env)
            wall = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-2000:])
            rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
            recorded = json.loads((Path(out) / "grpo_config.json").read_text())["num_threads"]
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    times = [r["step_time"] for r in rows if "step_time" in r][1:]
    return {"threads": threads, "recorded_threads": recorded, "busy": busy, "median_step_s": statistics.median(times),
            "wall_s": wall, "load_before": load}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "threads.json"))
    p.add_argument("--note", default="", help="What else the machine was doing, recorded with the numbers.")
    args = p.parse_args(argv)
    runs = []
    for repeat in range(args.repeats):
        for busy in (False, True):
            for threads in ((1, 2) if repeat % 2 == 0 else (2, 1)):
                run = {"repeat": repeat, **one_run(threads, args.steps, busy)}
                runs.append(run)
                print(json.dumps(run), flush=True)
    table = {}
    for busy in (False, True):
        for threads in (1, 2):
            cell = [r for r in runs if r["busy"] == busy and r["threads"] == threads]
            table[f"{'busy' if busy else 'quiet'}, {threads} thread{'s' if threads > 1 else ''}"] = {
                "median_step_s": statistics.median(r["median_step_s"] for r in cell),
                "median_wall_s": statistics.median(r["wall_s"] for r in cell),
                "load_before": [round(r["load_before"], 2) for r in cell]}
    result = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "steps": args.steps, "repeats": args.repeats, "cpus": os.cpu_count(),
              "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
              "note": args.note,
              "table": table, "runs": runs}
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
