"""Run under torchrun (or alone) by tests/test_distributed.py: train a few steps, then dump what the test compares.

    python tests/ddp_driver.py OUT_DIR MODE[,MODE...]

Each mode writes into OUT_DIR/MODE/, and the modes run one after another in one launch, so that the tests share the
cost of starting the processes (each launch imports torch and transformers on every rank). "signal" ends the process
group (main() does), so it goes last; "collectives" restores what it patched.

MODE "train": a few real steps; each rank saves its final parameters to params-{rank}.pt.
MODE "dynamic": a few steps of --dynamic_sampling where rank 0 keeps every group and rank 1 half of them, so the ranks
train different numbers of micro-batches; each rank saves its parameters and metrics to dynamic-{rank}.pt.
MODE "fixed": for each loss type, one step on fixed completions (the same 16 samples for any world size, split between
the ranks); rank 0 saves the gradient and the updated parameters to fixed-{loss_type}-{world}.pt. In one process it
also computes the gradient of each half on its own, as 2 ranks would, and saves their mean (what summing the ranks'
gradients, each divided by the number of ranks, gives) to fixed-{loss_type}-1x2.pt.
MODE "signal": SIGTERM reaches rank 1 alone, during the last step; each rank writes its exit code to exit-{rank}.txt.
MODE "grad": a parameter that only rank 0's forward reaches (an unused expert on rank 1); each rank saves its parameters
to grad-{rank}.pt.
MODE "collectives": runs through every branch a step and a run can take (skipped, empty and non-finite steps, dynamic
sampling, evaluation, checkpoints, completions, a stop signal) and writes each rank's sequence of collectives to
collectives-{rank}.json.
MODE "overwrite": two runs into one folder, the second overwriting the first, with rank 1 slow to read the folder;
each rank writes the number of lines in metrics.jsonl to overwrite-{rank}.txt.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo_ssr as g  # noqa: E402

TOTAL = 16  # completions in the union batch


def fixed_samples(pad_id: int) -> list[dict]:
    """16 samples with varied prompt and completion lengths, advantages and masks; the same on every rank."""
    gen = torch.Generator().manual_seed(123)
    out = []
    for i in range(TOTAL):
        p_len, c_len = 3 + i % 4, 2 + (i * 5) % 7
        prompt = torch.randint(0, 256, (8,), generator=gen)
        prompt_mask = (torch.arange(8) >= 8 - p_len).long()
        completion = torch.randint(0, 256, (9,), generator=gen)
        completion_mask = (torch.arange(9) < c_len).long()
        out.append(
            {
                "prompt_ids": torch.where(prompt_mask.bool(), prompt, pad_id),
                "prompt_mask": prompt_mask,
                "completion_ids": torch.where(completion_mask.bool(), completion, pad_id),
                "completion_mask": completion_mask,
                "old_per_token_logps": None,
                "ref_per_token_logps": None,
                "advantages": torch.randn((), generator=gen),
                "uid": i,
                "step": 0,
            }
        )
    return out


def main(out_dir: str, modes: str) -> None:
    for mode in modes.split(","):
        out = Path(out_dir) / mode
        out.mkdir(parents=True, exist_ok=True)
        MODES[mode](out)


def train(out: Path) -> None:
    cfg = g.GRPOConfig(
        output_dir=str(out / "run"),
        max_steps=3,
        device="cpu",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        overwrite_output_dir=True,
    )
    trainer = g.GRPOTrainer(cfg)
    trainer.train()
    torch.save([p.detach() for p in trainer.model.parameters()], out / f"params-{trainer.dist.rank}.pt")


def dynamic(out: Path) -> None:
    cfg = g.GRPOConfig(
        output_dir=str(out / "run"),
        max_steps=2,
        device="cpu",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        dynamic_sampling=True,
        max_generation_retries=0,
        eval_steps=0,
        overwrite_output_dir=True,
    )
    trainer = g.GRPOTrainer(cfg, reward_funcs=uneven_spread)
    history = trainer.train()
    torch.save(
        {"params": [p.detach() for p in trainer.model.parameters()], "history": history},
        out / f"dynamic-{trainer.dist.rank}.pt",
    )


def fixed(out: Path) -> None:
    world = int(g.os.environ.get("WORLD_SIZE", "1"))
    for loss_type in g.LOSS_TYPES:
        grads, trainer = one_step(out, loss_type, world, None)
        if trainer.dist.rank == 0:
            torch.save(
                {"grads": grads, "params": [p.detach() for p in trainer.model.parameters()]},
                out / f"fixed-{loss_type}-{world}.pt",
            )
        if world == 1:  # each half on its own: the gradients 2 ranks would compute before DDP averages them
            halves = [one_step(out, loss_type, 2, r)[0] for r in range(2)]
            torch.save({"grads": [sum(gs) / 2 for gs in zip(*halves)]}, out / f"fixed-{loss_type}-1x2.pt")


RANK = int(os.environ.get("RANK", "0"))
QUICK = ["--device", "cpu", "--per_device_train_batch_size", "8", "--num_generations", "4"]
QUICK += ["--max_completion_length", "4", "--eval_steps", "0", "--overwrite_output_dir"]


def sigterm_on_rank_1_in_step(step: int) -> None:
    """Patch train_step so that rank 1 alone receives SIGTERM during step `step` (counted from 1)."""
    real = g.GRPOTrainer.train_step

    def train_step(self):
        if RANK == 1 and self.step + 1 == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    g.GRPOTrainer.train_step = train_step


def stop_in_the_last_step(out: Path) -> None:
    sigterm_on_rank_1_in_step(3)
    code = g.main([*QUICK, "--max_steps", "3", "--output_dir", str(out / "run")])
    (out / f"exit-{RANK}.txt").write_text(str(code))


def gradient_on_rank_0_only(out: Path) -> None:
    model, tok = g.load_model("tiny")
    model.extra = torch.nn.Parameter(torch.zeros(()))  # scales the last hidden states on rank 0 only: no gradient on 1
    model.model.norm.register_forward_hook(lambda m, args, hidden: hidden * (1 + model.extra) if RANK == 0 else hidden)
    cfg = g.GRPOConfig(output_dir=str(out / "run"), max_steps=2, eval_steps=0, device="cpu", num_generations=4)
    cfg = g.dataclasses.replace(cfg, per_device_train_batch_size=8, max_completion_length=4, overwrite_output_dir=True)
    trainer = g.GRPOTrainer(cfg, model=model, processing_class=tok)
    trainer.train()
    torch.save({n: p.detach() for n, p in trainer.model.named_parameters()}, out / f"grad-{RANK}.pt")


def log_collectives(out: Path) -> None:
    patched = [(tdist, name) for name in ("all_reduce", "broadcast", "barrier", "all_gather_object")]
    patched += [(g, "grpo_loss"), (g.GRPOTrainer, "train_step")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched]
    try:
        run_every_branch(out)
    finally:  # the modes after this one in the same launch run unpatched
        for owner, name, value in originals:
            setattr(owner, name, value)


def run_every_branch(out: Path) -> None:
    log = []
    for name in ("all_reduce", "broadcast", "barrier", "all_gather_object"):
        real = getattr(tdist, name)

        def logged(*args, _real=real, _name=name, **kwargs):
            t = args[0] if args and torch.is_tensor(args[0]) else None
            log.append([_name, None if t is None else [list(t.shape), str(t.dtype)]])
            return _real(*args, **kwargs)

        setattr(tdist, name, logged)
    real_loss = g.grpo_loss
    losses = []

    def infinite_once_on_rank_1(*args, **kwargs):  # the second loss of the run, on rank 1 only
        loss, stats = real_loss(*args, **kwargs)
        losses.append(loss)
        return (loss * float("inf") if RANK == 1 and len(losses) == 2 else loss), stats

    g.grpo_loss = infinite_once_on_rank_1
    runs = {  # each takes its branch on one rank only, or on every rank after the ranks agree
        "empty steps, a non-finite step": ["--skip_empty_steps", "--reward_funcs", "ddp_driver.flat_every_other_call"],
        "skipped steps (SSR)": ["--replay_buffer_class", "ssr", "--reward_funcs", "ddp_driver.flat_on_rank_1"],
        "dynamic sampling": ["--dynamic_sampling", "--reward_funcs", "ddp_driver.uneven_spread"],
        "evaluation, checkpoints": ["--eval_steps", "2", "--eval_max_prompts", "4", "--save_steps", "2"],
        "completions, beta": ["--log_completions", "--beta", "0.1", "--gradient_accumulation_steps", "2"],
    }
    for name, flags in runs.items():
        log.append(["run", name])
        losses.clear()
        g.run(*g.parse_cli([*QUICK, "--max_steps", "4", *flags, "--output_dir", str(out / "run")]))
    log.append(["run", "a stop signal on rank 1 in step 2"])
    sigterm_on_rank_1_in_step(2)
    try:  # (not main(), which ends the process group)
        g.run(*g.parse_cli([*QUICK, "--max_steps", "4", "--output_dir", str(out / "run")]))
    except g.TrainingStopped as e:
        assert e.signum == signal.SIGTERM
    (out / f"collectives-{RANK}.json").write_text(json.dumps(log))


def overwrite_with_a_slow_rank_1(out: Path) -> None:
    """Two runs into one folder, the second with --overwrite_output_dir. Rank 1 reads the folder slowly (a slow disk):
    it finds metrics.jsonl, then reads it a second later; rank 0 starts emptying the folder half a second in. Before
    the ranks waited for each other there, rank 1's read found the file gone (FileNotFoundError)."""
    real_is_file, real_remove = Path.is_file, g._remove

    def is_file(path):
        found = real_is_file(path)
        if RANK == 1 and found and path.name == "metrics.jsonl":
            time.sleep(1)
        return found

    def remove(path):
        time.sleep(0.5)
        real_remove(path)

    Path.is_file, g._remove = is_file, remove
    try:
        for _ in range(2):
            g.run(*g.parse_cli([*QUICK, "--max_steps", "1", "--output_dir", str(out / "run")]))
    finally:
        Path.is_file, g._remove = real_is_file, real_remove
    (out / f"overwrite-{RANK}.txt").write_text(str(len(g.read_lines(out / "run" / "metrics.jsonl"))))


CALLS = []


def flat_every_other_call(completions, **kwargs) -> list[float]:
    """A spread in every group on odd calls, none on even ones: every other step is empty on every rank."""
    CALLS.append(1)
    return [float(i % 4 if len(CALLS) % 2 else 1) for i in range(len(completions))]


def flat_on_rank_1(completions, **kwargs) -> list:
    """Rank 0: a spread in every group. Rank 1: none (and no score for its first group): with SSR it has nothing
    to train on, generates again, and every rank skips the step."""
    if RANK == 0:
        return [float(i % 4) for i in range(len(completions))]
    return [None if i < 4 else 1.0 for i in range(len(completions))]


def uneven_spread(completions, **kwargs) -> list[float]:
    """Spread in every group of 4 on rank 0; on rank 1 only in the first two groups: it keeps 8 of 16 completions."""
    rank1 = g.os.environ.get("RANK") == "1"
    return [0.0 if rank1 and i >= 8 else float(i % 4) for i in range(len(completions))]


def one_step(out: Path, loss_type: str, world: int, share=None):
    """One train_step on this rank's share (or on share `share` of `world`); returns the gradient and the trainer."""
    cfg = g.GRPOConfig(
        output_dir=str(out / "fixed"),
        max_steps=1,
        device="cpu",
        loss_type=loss_type,
        per_device_train_batch_size=TOTAL // world,
        num_generations=4,
        max_completion_length=9,
        replay_buffer_class="ReplayBuffer",
        max_grad_norm=1e9,
        learning_rate=1e-2,
    )
    trainer = g.GRPOTrainer(cfg)
    rank = trainer.dist.rank if share is None else share
    share = fixed_samples(trainer.tokenizer.pad_token_id)[rank * TOTAL // world : (rank + 1) * TOTAL // world]
    trainer.generate_batch = lambda: share
    grads = {}
    real_step = trainer.optimizer.step

    def step(*a, **k):
        grads["g"] = [p.grad.detach().clone() for p in trainer.model.parameters()]
        return real_step(*a, **k)

    trainer.optimizer.step = step
    trainer.train_step()
    return grads["g"], trainer


MODES = {
    "train": train,
    "dynamic": dynamic,
    "fixed": fixed,
    "grad": gradient_on_rank_0_only,
    "collectives": log_collectives,
    "overwrite": overwrite_with_a_slow_rank_1,
    "signal": stop_in_the_last_step,
}

if __name__ == "__main__":
    main(*sys.argv[1:])
    if g.os.environ.get("WORLD_SIZE", "1") != "1" and torch.distributed.is_initialized():  # main() ends it itself
        # rank 0 may still be saving: tearing gloo down under it can abort the other rank ("terminate called
        # without an active exception", seen once on a loaded 2-core machine)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
