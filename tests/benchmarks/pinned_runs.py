"""Four pinned runs that prove a refactor: the same command before and after must give the same metrics.

Runs on the CPU are deterministic, so every field of every metrics.jsonl line except the timings must match. Each run
spells out every setting it depends on, so that a change of a default does not change it.

    python tests/benchmarks/pinned_runs.py --out /tmp/after                 # run the four, one thread each
    python tests/benchmarks/pinned_runs.py --compare tests/benchmarks/results/pinned /tmp/after
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

COMMON = [
    "--model",
    "tiny",
    "--dataset",
    "builtin",
    "--seed",
    "0",
    "--device",
    "cpu",
    "--num_threads",
    "1",
    "--max_steps",
    "60",
    "--eval_steps",
    "30",
    "--learning_rate",
    "1e-3",
    "--num_generations",
    "8",
    "--per_device_train_batch_size",
    "16",
    "--gradient_accumulation_steps",
    "1",
    "--num_iterations",
    "1",
    "--max_completion_length",
    "64",
    "--temperature",
    "1.0",
    "--loss_type",
    "dapo",
    "--scale_rewards",
    "group",
    "--max_generation_retries",
    "3",
    "--overwrite_output_dir",
]
RUNS = {
    "uniform": ["--reward_funcs", "reward_len", "--replay_buffer_class", "ReplayBuffer", "--beta", "0.0"],
    "uniform_beta": ["--reward_funcs", "reward_len", "--replay_buffer_class", "ReplayBuffer", "--beta", "0.04"],
    "ssr_replace": [
        "--reward_funcs",
        "reward_len_binary",
        "--replay_buffer_class",
        "SSRReplayBuffer",
        "--beta",
        "0.0",
        "--ssr_mode",
        "replace",
        "--ssr_capacity_scalar",
        "4",
        "--ssr_alpha",
        "1.0",
        "--ssr_age_decay",
        "2.0",
    ],
    "ssr_fill": [
        "--reward_funcs",
        "reward_len_binary",
        "--replay_buffer_class",
        "SSRReplayBuffer",
        "--beta",
        "0.0",
        "--ssr_mode",
        "fill",
        "--ssr_capacity_scalar",
        "4",
        "--ssr_alpha",
        "1.0",
        "--ssr_age_decay",
        "2.0",
    ],
}
TIMINGS = ("step_time", "eval_time")


def run_all(out: Path) -> None:
    import contextlib
    import io

    import grpo_ssr

    out.mkdir(parents=True, exist_ok=True)
    for name, flags in RUNS.items():
        folder = out / f"run-{name}"
        with contextlib.redirect_stdout(io.StringIO()):
            code = grpo_ssr.main(COMMON + flags + ["--output_dir", str(folder)])
        assert code == 0, f"{name}: exit {code}"
        (out / f"{name}.jsonl").write_text((folder / "metrics.jsonl").read_text())
        print(f"{name}: {len((folder / 'metrics.jsonl').read_text().splitlines())} lines")


def compare(before: Path, after: Path) -> int:
    bad = 0
    for name in RUNS:
        a = [json.loads(x) for x in (before / f"{name}.jsonl").read_text().splitlines()]
        b = [json.loads(x) for x in (after / f"{name}.jsonl").read_text().splitlines()]
        diffs = [
            (i, k)
            for i, (x, y) in enumerate(zip(a, b))
            for k in sorted(set(x) | set(y))
            if k not in TIMINGS and x.get(k) != y.get(k)
        ]
        same = len(a) == len(b) and not diffs
        bad += not same
        print(
            f"{name}: {len(a)} lines before, {len(b)} after: "
            + ("identical but for the timings" if same else f"differ, first at {diffs[:3]}")
        )
    return int(bad > 0)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="run the four and write <name>.jsonl here")
    p.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args()
    if args.out:
        run_all(args.out)
    sys.exit(compare(*args.compare) if args.compare else 0)
