"""The multi-seed study behind notebook 05: uniform replay (plain GRPO) against SSR, on two rewards.

For each reward (reward_len, reward_len_binary), each buffer (ReplayBuffer, SSRReplayBuffer) and each seed, it trains
the tiny model with grpo_ssr.run, reads the run's metrics.jsonl, and keeps a compact summary: every metric averaged
over bins of --bin steps, plus a few end-of-run numbers. Everything else the runs write (models, logs) is thrown away
unless --keep_runs is given.

    python notebooks/run_study.py                      # the committed results: 5 seeds, 250 steps, about 9 minutes
    python notebooks/run_study.py --seeds 0 --max_steps 40 --out /tmp/quick.json   # a smoke test
    python notebooks/run_study.py --rewards reward_len_binary --set ssr_capacity_scalar=1 --out /tmp/k1.json

Writes notebooks/results/study.json by default. The runs use one CPU thread: the tiny model gains nothing from more,
and on a busy 2-core machine two threads can make a step ten times slower.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers imports tqdm
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import grpo_ssr  # noqa: E402

REWARDS = ("reward_len", "reward_len_binary")
BUFFERS = ("ReplayBuffer", "SSRReplayBuffer")
METRICS = ("reward", "reward_std", "completion_length", "frac_reward_zero_std", "frac_truncated", "loss",
           "clip_ratio", "grad_norm", "replay_frac", "sample_age", "adv_abs_trained", "adv_abs_fresh", "buffer_size",
           "buffer_ess", "zero_adv_rejected", "generation_retries", "skipped", "step_time")


def binned(rows: list[dict], key: str, bin_size: int) -> list[float | None]:
    """Mean of `key` over consecutive bins of `bin_size` steps; None for a bin where no step logged it."""
    out = []
    for s in range(0, len(rows), bin_size):
        vals = [r[key] for r in rows[s:s + bin_size] if r.get(key) is not None]
        out.append(round(float(np.mean(vals)), 4) if vals else None)
    return out


def summarise(rows: list[dict], bin_size: int, tail: int) -> dict:
    """The compact record of one run."""
    last = rows[-tail:]
    generation_batches = sum(r["generated"] + r["generation_retries"] for r in rows)
    return {
        "binned": {k: binned(rows, k, bin_size) for k in METRICS},
        "final": {
            "reward_last": round(float(np.mean([r["reward"] for r in last])), 4),
            "completion_length_last": round(float(np.mean([r["completion_length"] for r in last])), 3),
            "frac_reward_zero_std_all": round(float(np.mean([r["frac_reward_zero_std"] for r in rows])), 4),
            "generation_batches": int(generation_batches),
            "skipped_steps": int(rows[-1]["skipped_steps"]),
            "first_step_with_spread": next((r["step"] for r in rows if r["frac_reward_zero_std"] < 1), None),
        },
    }


def parse_overrides(items: list[str]) -> dict:
    """FIELD=VALUE strings -> typed GRPOConfig keyword arguments (the type is taken from the field's default)."""
    defaults = vars(grpo_ssr.GRPOConfig())
    types = {f.name: f.type for f in dataclasses.fields(grpo_ssr.GRPOConfig)}
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in defaults or key in ("reward_funcs", "replay_buffer_class", "seed", "output_dir"):
            raise SystemExit(f"--set {item!r}: not a GRPOConfig field this script lets you set")
        kind = type(defaults[key])
        if kind is bool:
            out[key] = value.lower() in ("1", "true", "yes")
        elif defaults[key] is None:  # Optional[...] fields: the annotation (a string) names the type
            annotation = str(types[key])
            out[key] = float(value) if "float" in annotation else int(value) if "int" in annotation else value
        else:
            out[key] = kind(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--rewards", nargs="+", default=list(REWARDS), choices=REWARDS)
    p.add_argument("--buffers", nargs="+", default=list(BUFFERS), choices=BUFFERS)
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="override GRPOConfig fields for every run, e.g. ssr_capacity_scalar=1 learning_rate=3e-4")
    p.add_argument("--max_steps", type=int, default=250)
    p.add_argument("--bin", type=int, default=5, help="steps per bin in the saved curves")
    p.add_argument("--tail", type=int, default=50, help="steps averaged for the end-of-run numbers")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(HERE / "results" / "study.json"))
    p.add_argument("--keep_runs", action="store_true", help="keep the runs in notebooks/results/runs (git-ignored)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    runs_root = HERE / "results" / "runs" if args.keep_runs else Path(tempfile.mkdtemp(prefix="grpo_ssr_study_"))
    base = dict(max_steps=args.max_steps, device="cpu", **parse_overrides(args.set))
    study = {"settings": {**base, "seeds": args.seeds, "rewards": args.rewards, "buffers": args.buffers,
                          "bin": args.bin, "tail": args.tail, "threads": args.threads,
                          "defaults": {k: v for k, v in vars(grpo_ssr.GRPOConfig()).items()
                                       if k not in base and k != "output_dir"}},
             "environment": {"python": platform.python_version(), "torch": torch.__version__,
                             "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"},
             "runs": []}
    started = time.perf_counter()
    for reward in args.rewards:
        for buffer in args.buffers:
            for seed in args.seeds:
                out = runs_root / f"{reward}-{buffer}-seed{seed}"
                cfg = grpo_ssr.GRPOConfig(reward_funcs=reward, replay_buffer_class=buffer, seed=seed,
                                          output_dir=str(out), overwrite_output_dir=True, **base)
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):  # run() prints the resolved config
                    grpo_ssr.run(cfg)
                wall = time.perf_counter() - t0
                rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                        if "eval_reward" not in r]  # training lines only
                study["runs"].append({"reward": reward, "buffer": buffer, "seed": seed, "wall_s": round(wall, 1),
                                      **summarise(rows, args.bin, args.tail)})
                f = study["runs"][-1]["final"]
                print(f"{reward:18s} {buffer:16s} seed {seed}: reward(last {args.tail}) {f['reward_last']:8.3f}  "
                      f"length {f['completion_length_last']:5.1f}  zero-spread {f['frac_reward_zero_std_all']:.3f}  "
                      f"{wall:5.1f}s", flush=True)
    study["total_wall_s"] = round(time.perf_counter() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(study, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1024:.0f} KB) in {study['total_wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
