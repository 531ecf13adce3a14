"""SSR through the real training loop (GRPOTrainer.train_step, as main runs it), never with hand-built inputs.

These are the failures seen elsewhere that they must catch: only one group buffered per batch (a shape bug), SSR
silently off (a dead flag), replayed samples trained with a ratio of exactly 1 (no off-policy correction).
"""
import pytest
import torch

import grpo_ssr as g


def group_gated_reward(completions, prompts, **kw):
    """Length reward for half of the prompts, a constant for the other half: a known mix of zero-spread groups."""
    return [0.0 if ("cooking" in p or "running" in p) else -abs(20 - len(c)) for c, p in zip(completions, prompts)]


class Spy:
    """Records what the real loop generates, buffers and trains, by wrapping the trainer's own methods."""

    def __init__(self, trainer, monkeypatch):
        self.generated, self.drawn, self.trained, self.losses = [], [], [], []
        gen, sample = trainer.generate_batch, trainer.buffer.sample

        def generate_batch():
            samples = gen()
            self.generated.append(samples)
            return samples

        def buffer_sample(n):
            held = {id(s) for s in trainer.buffer.slots if s is not None}
            out = sample(n)
            assert all(id(s) in held for s in out), "a drawn sample was not in the buffer"
            self.drawn.append(out)
            return out

        real_repad, real_loss = g.repad, g.grpo_loss

        def repad(samples, padding_value):
            self.trained.append(list(samples))
            return real_repad(samples, padding_value)

        def grpo_loss(logps, old, adv, mask, **kw):
            loss, stats = real_loss(logps, old, adv, mask, **kw)
            self.losses.append({"logps": logps.detach(), "old": old.detach(), "adv": adv, "mask": mask,
                                "clip_ratio": stats["clip_ratio"].item(), **kw})
            return loss, stats

        trainer.generate_batch, trainer.buffer.sample = generate_batch, buffer_sample
        monkeypatch.setattr(g, "repad", repad)
        monkeypatch.setattr(g, "grpo_loss", grpo_loss)


def test_every_nonzero_sample_of_every_group_is_buffered(cfg_factory, monkeypatch):
    cfg = cfg_factory(per_device_train_batch_size=16, num_generations=4, max_steps=4)  # 4 groups a batch
    trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
    spy = Spy(trainer, monkeypatch)
    for _ in range(4):
        trainer.train_step()
        batch = spy.generated[-1]
        held = {s["uid"] for s in trainer.buffer.slots if s is not None}
        nonzero = {s["uid"] for s in batch if float(s["advantages"]) != 0}
        zero = {s["uid"] for s in batch if float(s["advantages"]) == 0}
        assert nonzero <= held and not (zero & held)
        groups = {u // cfg.num_generations for u in nonzero}
        assert len(groups) >= 2, "samples from more than one group must be buffered"
    assert trainer.buffer.rejected == sum(float(s["advantages"]) == 0 for b in spy.generated for s in b) > 0


def test_every_trained_micro_batch_comes_from_the_buffer(cfg_factory, monkeypatch):
    # replace, the pull request's design, whose draws this test follows
    cfg = cfg_factory(ssr_mode="replace", ssr_age_decay=0.0, gradient_accumulation_steps=2, max_steps=3)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
    spy = Spy(trainer, monkeypatch)
    for _ in range(3):
        trainer.train_step()
    assert len(spy.trained) == 3 * 2
    assert [[id(s) for s in mb] for mb in spy.trained] == [[id(s) for s in mb] for mb in spy.drawn]
    assert all(float(s["advantages"]) != 0 for mb in spy.trained for s in mb)


def test_ssr_is_really_on_it_prefers_large_advantages(cfg_factory, monkeypatch):
    """If SSR were silently off (uniform draws), trained |A| would match the buffer's mean |A|; it must exceed it."""
    # replace, the pull request's design, whose draws this test follows
    cfg = cfg_factory(ssr_mode="replace", ssr_age_decay=0.0, max_steps=12, ssr_alpha=2.0)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
    spy = Spy(trainer, monkeypatch)
    lifts = []
    for _ in range(12):
        held = None
        orig = trainer.buffer.sample

        def record(n, orig=orig):
            nonlocal held
            held = [float(s["advantages"].abs()) for s in trainer.buffer.slots if s is not None]
            return orig(n)

        trainer.buffer.sample = record
        m = trainer.train_step()
        trainer.buffer.sample = orig
        lifts.append(m["adv_abs_trained"] - sum(held) / len(held))
    assert sum(lifts) / len(lifts) > 0.1, lifts


def test_replayed_samples_use_stored_logps_ratio_differs_and_clipping_engages(cfg_factory, monkeypatch):
    # replace, the pull request's design, whose draws this test follows
    cfg = cfg_factory(ssr_mode="replace", ssr_age_decay=0.0, max_steps=4, epsilon=0.01, learning_rate=1e-2)
    trainer = g.GRPOTrainer(cfg)
    spy = Spy(trainer, monkeypatch)
    m1 = trainer.train_step()
    assert m1["replay_frac"] == 0.0
    first = spy.losses[-1]
    assert torch.allclose(first["logps"], first["old"], atol=1e-5)  # fresh samples: same weights, ratio 1
    assert first["clip_ratio"] == 0.0
    for _ in range(3):
        m = trainer.train_step()
    assert m["replay_frac"] > 0 and m["sample_age"] > 0
    rec = spy.losses[-1]
    replayed = [s["generation"] < trainer.generations - 1 for s in spy.trained[-1]]
    assert any(replayed)
    mask = rec["mask"].bool()
    ratio = torch.exp(rec["logps"] - rec["old"])
    rows = torch.tensor(replayed)
    assert (ratio[rows][mask[rows]] - 1).abs().max() > cfg.epsilon  # the stored, older log-probs are used
    # clipping engages exactly where the ratio leaves [1 - eps, 1 + eps] in the direction of the advantage
    adv = rec["adv"][:, None]
    should = (((ratio < 1 - cfg.epsilon) & (adv < 0)) | ((ratio > 1 + cfg.epsilon) & (adv > 0))) & mask
    assert should.any()
    assert rec["clip_ratio"] == pytest.approx(should.sum().item() / mask.sum().item(), abs=1e-6)


def test_all_zero_spread_retries_then_skips_without_crashing(cfg_factory, capsys):
    cfg = cfg_factory(max_steps=2, max_generation_retries=2)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[lambda completions, **kw: [1.0] * len(completions)])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history = trainer.train()
    assert [m["skipped"] for m in history] == [1, 1]
    assert [m["generation_retries"] for m in history] == [2, 2]
    assert history[-1]["skipped_steps"] == 2 and history[-1]["zero_adv_rejected"] == 2 * 3 * 8
    assert "skipped: the buffer is empty after 2 retries" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_retry_recovers_when_a_later_batch_has_spread(cfg_factory):
    calls = {"n": 0}

    def flat_then_length(completions, **kw):
        calls["n"] += 1
        return [0.0] * len(completions) if calls["n"] == 1 else g.reward_len(completions)

    trainer = g.GRPOTrainer(cfg_factory(max_steps=1), reward_funcs=[flat_then_length])
    m = trainer.train_step()
    assert m["generation_retries"] == 1 and m["skipped"] == 0 and m["buffer_size"] > 0
    assert m["frac_reward_zero_std"] < 1.0  # averaged over both batches, not just the lucky one
    assert m["frac_reward_zero_std"] >= 0.5


@pytest.mark.parametrize("num_iterations,accum", [(1, 1), (2, 2), (3, 1)])
def test_uniform_buffer_reproduces_plain_grpo(cfg_factory, monkeypatch, num_iterations, accum):
    """With --replay_buffer_class ReplayBuffer every sample is trained on exactly num_iterations times."""
    cfg = cfg_factory(replay_buffer_class="ReplayBuffer", num_iterations=num_iterations,
                      gradient_accumulation_steps=accum, max_steps=2 * num_iterations)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
    spy = Spy(trainer, monkeypatch)
    for _ in range(cfg.max_steps):
        trainer.train_step()
    counts = {}
    for mb in spy.trained:
        for s in mb:
            counts[s["uid"]] = counts.get(s["uid"], 0) + 1
    generated = [s["uid"] for b in spy.generated for s in b]
    assert len(spy.generated) == 2
    assert sorted(counts) == sorted(generated)  # zero-advantage samples are trained too, as in GRPO
    assert set(counts.values()) == {num_iterations}


def test_short_aliases_select_the_same_buffers(cfg_factory):
    assert type(g.make_buffer(cfg_factory(replay_buffer_class="ssr"))) is g.SSRReplayBuffer
    assert type(g.make_buffer(cfg_factory(replay_buffer_class="uniform"))) is g.ReplayBuffer
    cfg = cfg_factory()
    assert g.make_buffer(cfg).capacity == cfg.generation_batch_size * cfg.ssr_capacity_scalar


# --- ssr_mode fill, the age limit and Filter, through the real loop ----------------------------------------------

def _steps_of(spy, trainer, accum):
    """The samples each step trained, from the repad calls (one per micro-batch, accum per step)."""
    return [[s for mb in spy.trained[i:i + accum] for s in mb] for i in range(0, len(spy.trained), accum)]


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_fill_trains_every_fresh_nonzero_sample_in_the_step_that_made_it(cfg_factory, monkeypatch, num_iterations):
    """ssr_mode fill: every fresh non-zero sample trains in its batch's step(s), every time; buffer draws take
    exactly the slots of the zero-advantage ones. (In replace mode, or with SSR off, this fails.)"""
    accum, steps = 2, 6
    cfg = cfg_factory(ssr_mode="fill", gradient_accumulation_steps=accum, num_iterations=num_iterations,
                      max_steps=steps)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
    spy = Spy(trainer, monkeypatch)
    nonzero_seen = zero_seen = 0
    for step in range(steps):
        drawn_before = len(spy.drawn)
        m = trainer.train_step()
        fresh = spy.generated[-1]
        trained = _steps_of(spy, trainer, accum)[step]
        keep = [s for s in fresh if float(s["advantages"]) != 0]
        zero = [s for s in fresh if float(s["advantages"]) == 0]
        assert trained[:len(keep)] == keep, "every fresh non-zero sample trains, in the step that made it"
        draws = [s for d in spy.drawn[drawn_before:] for s in d]
        assert trained[len(keep):] == draws and len(draws) == len(zero)  # draws fill the zero slots, only them
        assert len(trained) == cfg.generation_batch_size and m["frac_zero_adv_trained"] == 0.0
        nonzero_seen, zero_seen = nonzero_seen + len(keep), zero_seen + len(zero)
    assert len(spy.generated) == steps // num_iterations  # the cadence: one batch per num_iterations steps
    assert nonzero_seen > 0 and zero_seen > 0


@pytest.mark.parametrize("mode", ["replace", "fill"])
def test_max_age_no_trained_sample_is_older_than_k(cfg_factory, monkeypatch, mode):
    ages = {}
    for max_age in (None, 1):
        cfg = cfg_factory(ssr_mode=mode, ssr_max_age=max_age, max_steps=10, output_dir=f"{max_age}")
        trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
        spy = Spy(trainer, monkeypatch)
        history, held_ages = [], []
        for _ in range(cfg.max_steps):
            history.append(trainer.train_step())
            held_ages += [trainer.step - 1 - s["step"] for s in trainer.buffer.slots if s is not None]
        trained = _steps_of(spy, trainer, 1)
        ages[max_age] = [step - s["step"] for step, samples in enumerate(trained) for s in samples]
        assert max(m["sample_age_max"] for m in history) == max(ages[max_age])
        if max_age is not None:
            assert max(held_ages) <= max_age  # too-old samples are evicted, not only skipped
    assert max(ages[None]) > 1, "without the limit this run replays older samples: the test has power"
    assert max(ages[1]) <= 1


def test_filter_trains_only_current_step_samples_and_regenerates(cfg_factory, monkeypatch):
    """Filter (fill, max_age 0): the zero slots repeat this step's own non-zero samples; a batch without any is
    generated again."""
    calls = {"n": 0}

    def flat_first(completions, prompts, **kw):
        calls["n"] += 1
        return [0.0] * len(completions) if calls["n"] == 1 else group_gated_reward(completions, prompts)

    cfg = cfg_factory(ssr_mode="fill", ssr_max_age=0, max_steps=5)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[flat_first])
    spy = Spy(trainer, monkeypatch)
    history = []
    for step in range(cfg.max_steps):
        history.append(trainer.train_step())
        samples = _steps_of(spy, trainer, 1)[step]
        fresh_nonzero = {id(s) for s in spy.generated[-1] if float(s["advantages"]) != 0}
        assert {id(s) for s in samples} <= fresh_nonzero, "Filter trains only this step's non-zero samples"
        assert all(s["step"] == step for s in samples)
    assert history[0]["generation_retries"] == 1 and history[0]["skipped"] == 0
    assert all(m["sample_age_max"] == 0 for m in history)
    assert any(m["unique_sample_frac"] < 1 for m in history)  # zero slots were filled by repeats


def binary_gated_reward(completions, prompts, **kw):
    """A binary reward (even length) for half of the prompts, 0 for the rest: zero-spread groups, no ties inside a
    group with spread, so the zero-advantage samples are exactly those of the zero-spread groups."""
    return [0.0 if ("cooking" in p or "running" in p) else float(len(c) % 2 == 0) for c, p in zip(completions, prompts)]


def test_trained_sample_metrics_tell_grpo_from_ssr(cfg_factory, monkeypatch):
    """Plain GRPO trains its zero-advantage samples (its share equals frac_reward_zero_std), SSR never does; each
    metric is recomputed from what the loop really trained. If SSR were silently off, frac_zero_adv_trained > 0."""
    for buffer, mode in (("ReplayBuffer", "replace"), ("SSRReplayBuffer", "replace"), ("SSRReplayBuffer", "fill")):
        cfg = cfg_factory(replay_buffer_class=buffer, ssr_mode=mode, max_steps=6, learning_rate=1e-2,
                          output_dir=f"{buffer}-{mode}")
        trainer = g.GRPOTrainer(cfg, reward_funcs=[binary_gated_reward])
        spy = Spy(trainer, monkeypatch)
        history = [trainer.train_step() for _ in range(cfg.max_steps)]
        for step, (m, samples, rec) in enumerate(zip(history, _steps_of(spy, trainer, 1), spy.losses)):
            zero = sum(float(s["advantages"]) == 0 for s in samples) / len(samples)
            assert m["frac_zero_adv_trained"] == pytest.approx(zero)
            assert m["unique_sample_frac"] == pytest.approx(len({s["uid"] for s in samples}) / len(samples))
            stale = torch.tensor([s["step"] < step for s in samples])[:, None] & rec["mask"].bool()
            if stale.any():
                expected = (rec["logps"] - rec["old"]).abs()[stale].mean().item()
                assert m["replay_abs_log_ratio"] == pytest.approx(expected, rel=1e-5)
            else:
                assert "replay_abs_log_ratio" not in m
            if buffer == "ReplayBuffer":
                assert m["frac_zero_adv_trained"] == pytest.approx(m["frac_reward_zero_std"])
                assert m["unique_sample_frac"] == 1.0 and m["sample_age_max"] == 0
            else:
                assert m["frac_zero_adv_trained"] == 0.0
        if buffer == "ReplayBuffer":
            assert max(m["frac_zero_adv_trained"] for m in history) > 0
        else:
            assert any(m.get("replay_abs_log_ratio", 0) > 0 for m in history)  # replays, from moved weights
