"""Micro-benchmark of grpo_ssr's replay buffers against a naive baseline, side by side in one run.

    python tests/benchmarks/bench_buffer.py               # capacity 65,536; about a minute
    python tests/benchmarks/bench_buffer.py --out /tmp/buffer.json

What is timed (each cell: the median over --repeats timings of a loop, divided by the loop's length):
- add: one sample per `add([sample])` call, amortised over --adds calls, once with the buffer near empty (its first
  --adds samples) and once full (every add evicts the oldest sample). A ring buffer should cost the same in both.
- sample(n), n = 16 and 256, with the buffer holding 1k, 16k and 65k samples:
  "repeat" draws again and again from an unchanged buffer (the uniform buffer then walks its shuffled queue and only
  reshuffles when it runs out); "after add" adds one sample before each draw, which is the training loop's pattern:
  every generation batch is followed by draws, and for the uniform buffer an add means a fresh shuffle.
  (The uniform buffer draws without replacement, SSR with replacement by |A|^alpha.)

The naive baseline (defined here) is what a first attempt looks like: a Python list, `list.pop(0)` to evict the oldest
sample when full, `random.sample` for uniform draws, and for SSR's weighted draws a Python loop over the cumulative
priorities for every sample drawn: O(n * size) per call.

Samples are real single-sample dicts (grpo_ssr.split_tensor_dict of a small batch) with non-zero advantages, so SSR
stores every one of them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402,F401  (puts the repository root on sys.path)
import grpo_ssr  # noqa: E402


class NaiveBuffer:
    """The baseline: a list with pop(0) eviction; uniform draws with random.sample, weighted draws in a Python loop."""

    def __init__(self, capacity: int, weighted: bool, alpha: float = 1.0, seed: int = 0):
        self.capacity, self.weighted, self.alpha = capacity, weighted, alpha
        self.items: list[dict] = []
        self.priorities: list[float] = []
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, samples: list[dict]) -> None:
        for s in samples:
            adv = abs(float(s["advantages"]))
            if self.weighted and adv == 0.0:
                continue
            self.items.append(s)
            self.priorities.append(adv**self.alpha)
            if len(self.items) > self.capacity:
                self.items.pop(0)  # O(size): shifts every pointer down by one
                self.priorities.pop(0)

    def sample(self, n: int) -> list[dict]:
        if not self.weighted:
            return self.rng.sample(self.items, n)
        total = sum(self.priorities)
        out = []
        for _ in range(n):
            r, acc = self.rng.random() * total, 0.0
            for item, p in zip(self.items, self.priorities):  # noqa: B007 (item is returned below)
                acc += p
                if acc >= r:
                    break
            out.append(item)
        return out


def make_samples(count: int, seed: int = 0) -> list[dict]:
    """Realistic single samples: 40-token prompt, 64-token completion, a non-zero advantage."""
    g = torch.Generator().manual_seed(seed)
    batch = {
        "prompt_ids": torch.randint(0, 256, (count, 40), generator=g),
        "prompt_mask": torch.ones(count, 40, dtype=torch.long),
        "completion_ids": torch.randint(0, 256, (count, 64), generator=g),
        "completion_mask": torch.ones(count, 64, dtype=torch.long),
        "advantages": torch.rand(count, generator=g) + 0.1,
        "old_per_token_logps": torch.randn(count, 64, generator=g),
        "ref_per_token_logps": None,
        "uid": list(range(count)),
        "step": [0] * count,
    }
    return grpo_ssr.split_tensor_dict(batch)


IMPLS = {
    "ReplayBuffer": lambda cap: grpo_ssr.ReplayBuffer(cap, seed=0),
    "naive uniform": lambda cap: NaiveBuffer(cap, weighted=False),
    "SSRReplayBuffer": lambda cap: grpo_ssr.SSRReplayBuffer(cap, alpha=1.0, seed=0),
    "naive weighted": lambda cap: NaiveBuffer(cap, weighted=True),
}


def fill(buf, pool: list[dict], count: int) -> None:
    for i in range(count):
        buf.add([pool[i % len(pool)]])


def per_call(fn, calls: int, repeats: int) -> float:
    """Median over `repeats` of the mean seconds per call of `calls` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def calls_for(seconds_per_call_guess: float, budget: float, lo: int = 3, hi: int = 2000) -> int:
    return int(min(hi, max(lo, budget / max(seconds_per_call_guess, 1e-9))))


def bench_add(name: str, capacity: int, pool: list[dict], adds: int, repeats: int) -> dict:
    out = {}
    for state in ("near empty", "full"):
        samples = []
        for _ in range(repeats):
            buf = IMPLS[name](capacity)
            if state == "full":
                fill(buf, pool, capacity)
            start = time.perf_counter()
            for i in range(adds):
                buf.add([pool[i % len(pool)]])
            samples.append((time.perf_counter() - start) / adds)
        out[state] = statistics.median(samples)
    return out


def bench_sample(name: str, capacity: int, size: int, n: int, pool: list[dict], repeats: int, budget: float) -> dict:
    buf = IMPLS[name](capacity)
    fill(buf, pool, size)
    probe = time.perf_counter()
    buf.sample(n)
    guess = time.perf_counter() - probe
    calls = calls_for(guess, budget, lo=1)
    repeats = repeats if guess < 0.05 else min(repeats, 3)  # the naive weighted draw takes ~1 s at 65k
    repeat = per_call(lambda i: buf.sample(n), calls, repeats)

    def add_then_draw(i):
        buf.add([pool[i % len(pool)]])
        buf.sample(n)

    add_only = per_call(lambda i: buf.add([pool[i % len(pool)]]), calls, repeats)
    after_add = max(0.0, per_call(add_then_draw, calls, repeats) - add_only)  # the draw's share only
    return {"repeat": repeat, "after add": after_add, "calls": calls}


def fmt(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:8.2f} ms"
    return f"{seconds * 1e6:8.2f} us"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=int, default=65_536)
    p.add_argument("--sizes", default="1024,16384,65536", help="fill levels for sample(n)")
    p.add_argument("--ns", default="16,256", help="draw sizes")
    p.add_argument("--adds", type=int, default=4096, help="add calls timed per cell")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.2, help="seconds of calls per timing loop")
    p.add_argument("--out", default=None, help="raw results as JSON (default /tmp/grpo_ssr_bench/buffer-TIME.json)")
    args = p.parse_args()
    sizes = [min(int(s), args.capacity) for s in args.sizes.split(",")]
    ns = [int(n) for n in args.ns.split(",")]
    torch.set_num_threads(1)  # buffer code is single-threaded; keep torch from spinning up a pool for tiny ops
    pool = make_samples(4096)
    results = {
        "date": h.today(),
        "machine": h.machine(),
        "versions": h.versions(),
        "args": vars(args),
        "add": {},
        "sample": [],
    }
    print(f"capacity {args.capacity:,}; median of {args.repeats} timings per cell; {h.machine()}\n", flush=True)

    print("add one sample (amortised over {:,} calls of add([sample]))".format(args.adds))
    print(f"| {'implementation':16s} | {'near empty':>11s} | {'full (evicts)':>13s} |")
    print(f"|{'-' * 18}|{'-' * 13}|{'-' * 15}|")
    for name in IMPLS:
        r = bench_add(name, args.capacity, pool, args.adds, args.repeats)
        results["add"][name] = r
        print(f"| {name:16s} | {fmt(r['near empty']):>11s} | {fmt(r['full']):>13s} |", flush=True)

    print('\nsample(n): seconds per call ("after add": the draw\'s share when each draw follows an add)')
    print(
        f"| {'implementation':16s} | {'size':>6s} | {'n':>4s} | {'repeat':>11s} | {'after add':>11s} |"
        f" {'per sample':>11s} |"
    )
    print(f"|{'-' * 18}|{'-' * 8}|{'-' * 6}|{'-' * 13}|{'-' * 13}|{'-' * 13}|")
    for size in sizes:
        for n in ns:
            for name in IMPLS:
                r = bench_sample(name, args.capacity, size, n, pool, args.repeats, args.budget)
                results["sample"].append({"impl": name, "size": size, "n": n, **r})
                print(
                    f"| {name:16s} | {size:>6,} | {n:>4} | {fmt(r['repeat']):>11s} | {fmt(r['after add']):>11s} |"
                    f" {fmt(r['repeat'] / n):>11s} |",
                    flush=True,
                )
        print(f"|{'':18s}|{'':8s}|{'':6s}|{'':13s}|{'':13s}|{'':13s}|")

    out = Path(args.out or f"/tmp/grpo_ssr_bench/buffer-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nraw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
