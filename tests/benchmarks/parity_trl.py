"""Loss and gradient parity with TRL 1.16's GRPOTrainer._compute_loss, on one model and one batch.

    PYTHONPATH=/path/to/trl python tests/benchmarks/parity_trl.py

The batch is what a replayed SSR step looks like: old log-probs from another policy (off-policy ratios, some of them
clipped), reference log-probs from a third, completions of unequal lengths (right padding), and advantages of both
signs. Prompts have equal lengths: TRL's log-prob forward does not pass position ids, so left padding would test the
positions rather than the loss. For every loss type, beta 0 and 0.04, and both values of use_bias_correction_kl, the
script computes our per_token_logps + grpo_loss and TRL's _compute_loss (temperature 0.7, one micro-batch), runs
backward on each, and compares the loss and every parameter's gradient. It fails (exit 1) if any relative difference
exceeds 1e-5. Not collected by pytest; needs TRL (tests/benchmarks/requirements.txt).
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_ssr as g  # noqa: E402
from _harness import machine, versions  # noqa: E402

B, P, C, T, EPSILON, TOLERANCE = 8, 6, 9, 0.7, 0.2, 1e-5


def make_batch(model, pad_id: int) -> dict:
    """Equal-length prompts, completions of 1..9 tokens, log-probs of two perturbed copies of the policy."""
    gen = torch.Generator().manual_seed(7)
    prompt_ids = torch.randint(0, 256, (B, P), generator=gen)
    lengths = torch.tensor([9, 3, 6, 1, 8, 5, 2, 7])
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    completion_ids = torch.where(completion_mask.bool(), torch.randint(0, 256, (B, C), generator=gen), pad_id)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)

    def perturbed_logps(scale: float, seed: int) -> torch.Tensor:
        other = g.copy.deepcopy(model)
        noise = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(torch.randn(p.shape, generator=noise) * scale)
            return g.per_token_logps(other, input_ids, attention_mask, C, temperature=T)

    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=gen),
        "old_per_token_logps": perturbed_logps(0.1, 1),
        "ref_per_token_logps": perturbed_logps(0.3, 2),
        "num_items_in_batch": completion_mask.sum().float(),
    }


def ours(model, batch: dict, loss_type: str, beta: float, bias_correction: bool):
    model.zero_grad()
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    logps = g.per_token_logps(model, input_ids, attention_mask, C, temperature=T)
    loss, _ = g.grpo_loss(
        logps,
        batch["old_per_token_logps"],
        batch["advantages"],
        batch["completion_mask"],
        epsilon_low=EPSILON,
        beta=beta,
        ref_logps=batch["ref_per_token_logps"],
        loss_type=loss_type,
        use_bias_correction_kl=bias_correction,
        max_completion_length=C,
        num_items_in_batch=float(batch["num_items_in_batch"]),
    )
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def trl_trainer(model_dir: str, out: str, loss_type: str, beta: float, bias_correction: bool):
    import trl
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=B,
        num_generations=4,
        max_completion_length=C,
        temperature=T,
        loss_type=loss_type,
        beta=beta,
        use_bias_correction_kl=bias_correction,
        epsilon=EPSILON,
        scale_rewards="group",
        gradient_accumulation_steps=1,
        disable_tqdm=True,
    )
    dataset = Dataset.from_list(g.builtin_prompts())
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=[g.reward_len], args=args, train_dataset=dataset)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() in a real run
    trainer.model.train()
    return trainer


def theirs(trainer, batch: dict):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, dict(batch))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def main() -> int:
    torch.manual_seed(0)
    tok = g.build_tiny_tokenizer()
    model = g.build_tiny_model(len(tok))
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp) / "model")
        tok.save_pretrained(Path(tmp) / "model")
        our_model, _ = g.load_model(str(Path(tmp) / "model"))
        our_model.train()
        batch = make_batch(our_model, tok.pad_token_id)
        for loss_type, beta, bias_correction in itertools.product(g.LOSS_TYPES, (0.0, 0.04), (True, False)):
            trainer = trl_trainer(str(Path(tmp) / "model"), str(Path(tmp) / "trl"), loss_type, beta, bias_correction)
            assert all(
                torch.equal(a, b) for a, b in zip(our_model.state_dict().values(), trainer.model.state_dict().values())
            )
            loss_a, grads_a = ours(our_model, batch, loss_type, beta, bias_correction)
            loss_b, grads_b = theirs(trainer, batch)
            grad_err = max(relative(grads_a[n], grads_b[n]) for n in grads_b)
            loss_err = abs(loss_a - loss_b) / max(abs(loss_b), 1e-30)
            worst = max(worst, grad_err, loss_err)
            rows.append(
                {
                    "loss_type": loss_type,
                    "beta": beta,
                    "use_bias_correction_kl": bias_correction,
                    "loss_ours": loss_a,
                    "loss_trl": loss_b,
                    "loss_rel_err": loss_err,
                    "max_grad_rel_err": grad_err,
                    "parameters": len(grads_b),
                }
            )
            print(
                f"{loss_type:8s} beta={beta:<5} bias_correction={bias_correction!s:5s}  loss {loss_a:+.8f} vs "
                f"{loss_b:+.8f}  rel.err loss {loss_err:.1e}, worst gradient {grad_err:.1e}",
                flush=True,
            )
    ok = worst <= TOLERANCE
    print(
        json.dumps(
            {
                "cases": len(rows),
                "worst_rel_err": worst,
                "tolerance": TOLERANCE,
                "pass": ok,
                "machine": machine(),
                "versions": versions(),
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
