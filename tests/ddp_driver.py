"""Run under torchrun (or alone) by tests/test_distributed.py: train a few steps, then dump what the test compares.

    python tests/ddp_driver.py OUT_DIR MODE

MODE "train": a few real steps; each rank saves its final parameters to OUT_DIR/params-{rank}.pt.
MODE "dynamic": a few steps of --dynamic_sampling where rank 0 keeps every group and rank 1 half of them, so the ranks
train different numbers of micro-batches; each rank saves its parameters and metrics to OUT_DIR/dynamic-{rank}.pt.
MODE "fixed": for each loss type, one step on fixed completions (the same 16 samples for any world size, split between
the ranks); rank 0 saves the gradient and the updated parameters to OUT_DIR/fixed-{loss_type}-{world}.pt. In one
process it also computes the gradient of each half on its own, as 2 ranks would, and saves their mean (what DDP's
averaging gives) to OUT_DIR/fixed-{loss_type}-1x2.pt.
"""

import sys
from pathlib import Path

import torch

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


def main(out_dir: str, mode: str) -> None:
    out = Path(out_dir)
    if mode == "train":
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
        return
    if mode == "dynamic":
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
        return
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


if __name__ == "__main__":
    main(*sys.argv[1:])
    if g.os.environ.get("WORLD_SIZE", "1") != "1":
        # rank 0 may still be saving: tearing gloo down under it can abort the other rank ("terminate called
        # without an active exception", seen once on a loaded 2-core machine)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
