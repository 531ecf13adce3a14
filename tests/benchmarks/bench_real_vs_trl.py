"""grpo_ssr against TRL's GRPOTrainer on the real model: SmolLM2-135M-Instruct on the arithmetic task, CPU.

    python tests/benchmarks/bench_real_vs_trl.py                    # 2 repeats of each, N = 3 (9-step runs)
    python tests/benchmarks/bench_real_vs_trl.py --no_bf16 --repeats 3 --out /tmp/real_vs_trl.json

The companion of bench_vs_trl.py (the tiny model), with the same harness (_harness.py) and the same method: each run
is its own process, ours and TRL alternate, the steady state is (end of step 3N - end of step N) / 2N, and the peak
resident memory of each process comes from os.wait4. Identical inputs: the model is the folder `--model
smollm2-135m-instruct` converts to (grpo_ssr.preset_folder), the prompts are the arithmetic training questions as
chat messages with their `answer` column (a .jsonl file), and the reward is grpo_ssr.reward_accuracy for both.
Settings are the CPU recipe's (README): 16 completions a step, 8 per prompt, at most 8 new tokens, temperature 0.7,
learning rate 2e-5, bf16 autocast on the CPU in both (--no_bf16: float32 in both), the uniform buffer (plain GRPO)
for ours, loss bnpo, beta 0, no evaluation.

By default it does not wait for a quiet machine (a real-model step takes seconds, so waiting before each run costs
little accuracy but a lot of time); --wait uses the harness's wait_for_quiet and reruns disturbed runs. The load
other processes put on the machine during each run is recorded either way (`other_load`, in cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--n", type=int, default=3, help="N: steady state from step N to step 3N")
    p.add_argument("--no_bf16", action="store_true")
    p.add_argument("--wait", action="store_true", help="wait for a quiet machine before each run")
    p.add_argument("--out", default=None, help="write the raw results here (JSON)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data_path = h.prepare_real_inputs(Path(tmp))
        results = {"ours": [], "trl": []}
        for r in range(args.repeats):
            for trainer in ("ours", "trl"):
                spec = h.RunSpec(
                    trainer=trainer,
                    model_dir=model_dir,
                    data_path=data_path,
                    result_path=str(Path(tmp) / f"{trainer}-{r}.json"),
                    max_steps=3 * args.n,
                    learning_rate=2e-5,
                    batch_size=16,
                    num_generations=8,
                    max_completion_length=8,
                    temperature=0.7,
                    seed=r,
                    reward="reward_accuracy",
                    bf16=not args.no_bf16,
                )
                res = h.launch_quiet(spec) if args.wait else h.launch(spec)
                res["s_per_step"] = h.steady_seconds_per_step(res["step_ends"], args.n)
                results[trainer].append(res)
                print(
                    f"repeat {r} {trainer:4s}: {res['s_per_step']:.2f} s/step, peak RSS "
                    f"{res['peak_rss_mib'] / 1024:.2f} GiB, other processes {res['other_load']:.2f} cores",
                    flush=True,
                )
    med = {t: h.median([x["s_per_step"] for x in v]) for t, v in results.items()}
    mem = {t: h.median([x["peak_rss_mib"] for x in v]) / 1024 for t, v in results.items()}
    print(
        f"median s/step: ours {med['ours']:.2f}, TRL {med['trl']:.2f}, ratio {med['ours'] / med['trl']:.2f}; "
        f"peak RSS: ours {mem['ours']:.2f} GiB, TRL {mem['trl']:.2f} GiB, ratio {mem['ours'] / mem['trl']:.2f}"
    )
    if args.out:
        keep = ("s_per_step", "peak_rss_mib", "wall_s", "other_load", "spec", "torch_threads", "trl_sampling")
        Path(args.out).write_text(
            json.dumps(
                {
                    "date": h.today(),
                    "machine": h.machine(),
                    "versions": h.versions(),
                    "median_s_per_step": med,
                    "median_peak_rss_gib": mem,
                    "runs": {t: [{k: x.get(k) for k in keep} for x in v] for t, v in results.items()},
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
