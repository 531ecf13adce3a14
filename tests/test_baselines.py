"""The baselines replay is compared with, through the real loop: DAPO's dynamic sampling, and GRPO that skips the
optimizer update of a step with no signal."""
import pytest
import torch

import grpo_ssr as g


def group_gated_reward(completions, prompts, **kw):
    """Length reward for half of the prompts, a constant for the other half: a known mix of zero-spread groups."""
    return [0.0 if ("cooking" in p or "running" in p) else -abs(20 - len(c)) for c, p in zip(completions, prompts)]


def mostly_gated_reward(completions, prompts, **kw):
    """The length reward on two subreddits of six, a constant on the others: most groups have no spread."""
    return [-abs(20 - len(c)) if ("AskDocs" in p or "legaladvice" in p) else 0.0 for c, p in zip(completions, prompts)]


def constant_reward(completions, **kw):
    return [1.0] * len(completions)


def spy_training(trainer, monkeypatch):
    """Record every generation batch and every trained micro-batch of the real loop."""
    generated, trained = [], []
    gen, real_repad = trainer.generate_batch, g.repad

    def generate_batch():
        generated[-1].append(gen()) if generated else None
        return generated[-1][-1]

    def repad(samples, padding_value):
        trained[-1].append(list(samples))
        return real_repad(samples, padding_value)

    trainer.generate_batch = generate_batch
    monkeypatch.setattr(g, "repad", repad)

    def step():
        generated.append([])
        trained.append([])
        return trainer.train_step()
    return step, generated, trained


def test_dynamic_sampling_trains_only_groups_with_spread_and_fills_the_batch(cfg_factory, monkeypatch):
    cfg = cfg_factory(replay_buffer_class="ReplayBuffer", dynamic_sampling=True, per_device_train_batch_size=8,
                      gradient_accumulation_steps=2, num_generations=4, max_generation_retries=5, max_steps=4)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
    step, generated, trained = spy_training(trainer, monkeypatch)
    for _ in range(4):
        m = step()
        batches, micro = generated[-1], trained[-1]
        assert 1 <= len(batches) <= 1 + cfg.max_generation_retries
        assert m["generation_retries"] == len(batches) - 1
        groups = [b[i:i + 4] for b in batches for i in range(0, len(b), 4)]
        spread = [grp for grp in groups if any(float(s["advantages"]) != 0 for s in grp)]
        flat = [s for mb in micro for s in mb]
        assert [s["uid"] for s in flat] == [s["uid"] for grp in spread[:4] for s in grp]  # the first 4, in order
        assert len(flat) == cfg.generation_batch_size and m["frac_batch_filled"] == 1.0
        assert m["groups_dropped"] == len(groups) - 4
        for i in range(0, len(flat), 4):  # every trained group has spread
            assert len({float(s["advantages"]) for s in flat[i:i + 4]}) > 1
        assert len(trainer.buffer) == 0  # no replay


def test_dynamic_sampling_respects_the_cap_and_trains_a_part_batch(cfg_factory, monkeypatch):
    cfg = cfg_factory(replay_buffer_class="ReplayBuffer", dynamic_sampling=True, per_device_train_batch_size=16,
                      num_generations=4, max_generation_retries=0, max_steps=4)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[mostly_gated_reward])
    step, generated, trained = spy_training(trainer, monkeypatch)
    part = 0
    for _ in range(4):
        m = step()
        assert len(generated[-1]) == 1 and m["generation_retries"] == 0
        with_spread = sum(any(float(s["advantages"]) != 0 for s in generated[-1][0][i:i + 4]) for i in (0, 4, 8, 12))
        part += 0 < with_spread < 4
        assert sum(len(mb) for mb in trained[-1]) == 4 * with_spread
        assert m["frac_batch_filled"] == with_spread / 4 and m["groups_dropped"] == 4 - with_spread
    assert part > 0, "some step trained a part batch"


def test_dynamic_sampling_with_no_spread_generates_to_the_cap_then_skips(cfg_factory, monkeypatch):
    cfg = cfg_factory(replay_buffer_class="ReplayBuffer", dynamic_sampling=True, max_generation_retries=2,
                      max_steps=2)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[constant_reward])
    step, generated, trained = spy_training(trainer, monkeypatch)
    m = step()
    assert len(generated[-1]) == 3 and trained[-1] == [] and m["skipped"] == 1
    assert m["generation_retries"] == 2 and m["completions"] == cfg.generation_batch_size  # per batch, as always


def test_dynamic_sampling_needs_the_uniform_buffer(cfg_factory):
    with pytest.raises(g.ConfigError, match="--dynamic_sampling"):
        g.validate_config(cfg_factory(dynamic_sampling=True))


class SignalOnce:
    """A length reward on the first generation batch, then the same reward for everyone: one real step, then none."""

    def __init__(self):
        self.calls = 0

    def __call__(self, completions, **kw):
        self.calls += 1
        return [-abs(20 - len(c)) for c in completions] if self.calls == 1 else [0.0] * len(completions)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_an_empty_step_moves_the_weights_unless_skipped(cfg_factory, weight_decay):
    after = {}
    for skip in (False, True):
        cfg = cfg_factory(replay_buffer_class="ReplayBuffer", skip_empty_steps=skip, max_steps=4,
                          weight_decay=weight_decay, learning_rate=1e-3)
        trainer = g.GRPOTrainer(cfg, reward_funcs=[SignalOnce()])
        first = trainer.train_step()
        assert first["frac_zero_adv_trained"] < 1 and "skipped_empty" not in first
        weights = [p.detach().clone() for p in trainer.model.parameters()]
        rest = [trainer.train_step() for _ in range(3)]
        assert all(m["frac_zero_adv_trained"] == 1 for m in rest)  # no signal: the loss and gradient are 0
        moved = max((p - w).abs().max().item() for p, w in zip(trainer.model.parameters(), weights))
        after[skip] = moved, rest, trainer
    moved, rest, trainer = after[False]
    assert moved > 1e-4, "AdamW's momentum moves the weights on a step whose gradient is 0"
    assert all(m["grad_norm"] == 0 and m["skipped"] == 0 for m in rest)
    moved, rest, trainer = after[True]
    assert moved == 0
    assert all(m["skipped"] == 1 and m["skipped_empty"] == 1 and m["loss"] == 0 for m in rest)
    assert trainer.counters["empty_steps_skipped"] == 3 and trainer.step == 4
    assert [m["learning_rate"] for m in rest] == [m["learning_rate"] for m in after[False][1]]  # schedule advances


def test_a_kl_term_is_signal(cfg_factory):
    cfg = cfg_factory(replay_buffer_class="ReplayBuffer", skip_empty_steps=True, beta=0.1, max_steps=2)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[constant_reward])
    trainer.train_step()
    m = trainer.train_step()  # the weights moved in step 1 (AdamW with a zero reward gradient... and the KL)
    assert "skipped_empty" not in m and trainer.counters["empty_steps_skipped"] == 0
