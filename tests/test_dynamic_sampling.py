"""DAPO's dynamic sampling through the real loop: what a step that makes several generation batches logs, and how it
weighs the rows of a part batch."""

import pytest
import torch

import grpo_ssr as g

PROMPTS = [{"prompt": p} for p in ("a", "b", "c", "d")]


def spread_for(*kept):
    """A reward that gives each group of 4 of the prompts in `kept` the spread 0, 1, 2, 3, and every other group 0:
    dynamic sampling keeps exactly those groups."""
    calls = []

    def reward(completions, prompts, **kwargs):
        calls.append(len(completions))
        return [float(i % 4) if p in kept else 0.0 for i, p in enumerate(prompts)]

    return reward, calls


def dapo_trainer(cfg_factory, reward, **overrides):
    cfg = cfg_factory(
        replay_buffer_class="ReplayBuffer",
        dynamic_sampling=True,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_generations=4,
        eval_steps=0,
        **overrides,
    )
    return g.GRPOTrainer(cfg, reward_funcs=reward, train_dataset=PROMPTS)


@pytest.mark.slow
def test_completions_count_every_generation_batch_of_a_step(cfg_factory):
    """One group in four has spread, so each step makes 4 generation batches of 16 to fill its 16 rows: the metrics
    line says 64 completions, and over the run the logged completions are the ones the reward function scored."""
    reward, calls = spread_for("a")
    history = dapo_trainer(cfg_factory, reward, max_steps=3, max_generation_retries=3).train()
    assert [m["generation_retries"] for m in history] == [3, 3, 3]
    assert [m["completions"] for m in history] == [64.0, 64.0, 64.0]
    assert sum(m["completions"] for m in history) == sum(calls) == 192


@pytest.mark.slow
def test_dynamic_sampling_replays_nothing(cfg_factory):
    """The kept groups come from the step's four generation batches, all generated in the step that trains them:
    none is replayed, whatever batch of the step it came from."""
    reward, _ = spread_for("a")
    history = dapo_trainer(cfg_factory, reward, max_steps=2, max_generation_retries=3).train()
    assert [m["replay_frac"] for m in history] == [0.0, 0.0] and all(m["sample_age"] == 0 for m in history)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_every_row_of_a_part_batch_weighs_the_same(cfg_factory, monkeypatch, loss_type):
    """Three groups in four have spread and no retry is allowed: the step trains a part batch of 12 rows, as
    micro-batches of 8 and 4. Each row's gradient is that of one row in 12 (verl's agg_loss, and this loss on the
    same rows as one batch): d loss / d logp = -A / (12 * tokens) for grpo, -A / (12 * max_completion_length) for
    dr_grpo, in both micro-batches."""
    reward, _ = spread_for("a", "b", "c")
    trainer = dapo_trainer(cfg_factory, reward, max_steps=1, max_generation_retries=0, loss_type=loss_type)
    seen, real = [], g.grpo_loss

    def watched(logps, old, advantages, mask, **kw):
        logps.retain_grad()
        seen.append((logps, advantages, mask))
        return real(logps, old, advantages, mask, **kw)

    monkeypatch.setattr(g, "grpo_loss", watched)
    assert trainer.train_step()["frac_batch_filled"] == 0.75
    assert [len(a) for _, a, _ in seen] == [8, 4]
    for logps, advantages, mask in seen:
        live = mask.bool() & (advantages != 0)[:, None]
        per_row = mask.sum(1, keepdim=True) if loss_type == "grpo" else trainer.cfg.max_completion_length
        weight = (logps.grad * per_row / -advantages[:, None])[live]  # each row's share of the step
        assert torch.allclose(weight, torch.full_like(weight, 1 / 12), rtol=1e-5), (loss_type, weight.unique())
