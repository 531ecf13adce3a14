"""One optimizer step (Part I, 7) through the real loop, never with hand-built inputs: generation and its cadence, SSR
(what is buffered, drawn and trained, in both modes, with the age limit and as Filter), the baselines (plain GRPO,
DAPO's dynamic sampling, skipping empty steps), steps without signal or with a non-finite loss, the schedule, notebook
05's step by hand, and four configurations pinned to what they computed before the file was restructured.

The failures seen elsewhere that these must catch: only one group buffered per batch (a shape bug), SSR silently off
(a dead flag), replayed samples trained with a ratio of exactly 1 (no off-policy correction), and old log-probs
taken from a training forward where they are not provably the behaviour policy's.
"""

import json

import pytest
import torch

import grpo_ssr as g
from conftest import ROOT

SSR = dict(replay_buffer_class="SSRReplayBuffer")  # SSR with its defaults (fill, age decay 2); the default: plain GRPO


def group_gated_reward(completions, prompts, **kw):
    """Length reward for half of the prompts, a constant for the other half: a known mix of zero-spread groups."""
    return [0.0 if ("cooking" in p or "running" in p) else -abs(20 - len(c)) for c, p in zip(completions, prompts)]


def mostly_gated_reward(completions, prompts, **kw):
    """The length reward on two subreddits of six, a constant on the others: most groups have no spread."""
    return [-abs(20 - len(c)) if ("AskDocs" in p or "legaladvice" in p) else 0.0 for c, p in zip(completions, prompts)]


def constant_reward(completions, **kw):
    return [1.0] * len(completions)


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
            self.losses.append(
                {
                    "logps": logps.detach(),
                    "old": old.detach(),
                    "adv": adv,
                    "mask": mask,
                    "clip_ratio": stats["clip_ratio"].item(),
                    **kw,
                }
            )
            return loss, stats

        trainer.generate_batch, trainer.buffer.sample = generate_batch, buffer_sample
        monkeypatch.setattr(g, "repad", repad)
        monkeypatch.setattr(g, "grpo_loss", grpo_loss)


def spy_training(trainer, monkeypatch):
    """The Spy's records step by step: a step() that runs train_step, and each step's generation batches and trained
    micro-batches."""
    spy = Spy(trainer, monkeypatch)
    generated, trained = [], []

    def step():
        batches, micro = len(spy.generated), len(spy.trained)
        metrics = trainer.train_step()
        generated.append(spy.generated[batches:])
        trained.append(spy.trained[micro:])
        return metrics

    return step, generated, trained


def _steps_of(spy, trainer, accum):
    """The samples each step trained, from the repad calls (one per micro-batch, accum per step)."""
    return [[s for mb in spy.trained[i : i + accum] for s in mb] for i in range(0, len(spy.trained), accum)]


# --- generation and its cadence ---------------------------------------------------------------------------------------


def test_old_logps_forward_is_skipped_only_where_every_sample_trains_in_its_own_step(cfg_factory):
    for flags, skipped in (
        (dict(replay_buffer_class="ReplayBuffer"), True),
        (dict(replay_buffer_class="ReplayBuffer", num_iterations=2), True),
        (dict(), True),  # the default: plain GRPO
        (dict(**SSR), True),  # SSR fill, num_iterations 1
        (dict(**SSR, num_iterations=2), False),  # fill: a zero slot may keep its own sample later
        (dict(**SSR, ssr_mode="replace"), False),
    ):
        trainer = g.GRPOTrainer(cfg_factory(**flags))
        assert all((s["old_per_token_logps"] is None) is skipped for s in trainer.generate_batch()), flags


def test_generation_is_decided_by_all_ranks_together(cfg_factory, monkeypatch):
    """num_iterations 2: this rank would reuse its batch on step 2, but another rank must generate (its buffer
    ran dry): so this rank generates too, and both walk the prompt order in step."""
    trainer = g.GRPOTrainer(cfg_factory(num_iterations=2, replay_buffer_class="ReplayBuffer"))
    assert trainer.train_step()["generated"] == 1
    real = trainer.dist.reduce
    calls = []
    monkeypatch.setattr(
        trainer.dist,
        "reduce",
        lambda values, op="sum": (
            calls.append((list(values), op)) or ([1.0] if op == "max" and len(calls) == 1 else real(values, op))
        ),
    )
    before = trainer.prompts_drawn
    m = trainer.train_step()
    assert calls[0] == ([0.0], "max")  # this rank alone would not have generated
    assert m["generated"] == 1 and trainer.prompts_drawn == before + 2  # 8 completions a step, groups of 4


def test_all_zero_spread_retries_then_skips_without_crashing(cfg_factory, capsys):
    cfg = cfg_factory(max_steps=2, max_generation_retries=2, **SSR)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[lambda completions, **kw: [1.0] * len(completions)])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history = trainer.train()
    assert [m["skipped"] for m in history] == [1, 1]
    assert [m["generation_retries"] for m in history] == [2, 2]
    assert history[-1]["skipped_steps"] == 2 and history[-1]["zero_adv_rejected"] == 2 * 3 * 8
    err = capsys.readouterr().err  # the progress bar's too
    for n in (1, 2):
        assert f"warning: step {n} skipped: no group had reward spread, or a score, after 2 retries\n" in err
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_retry_recovers_when_a_later_batch_has_spread(cfg_factory):
    calls = {"n": 0}

    def flat_then_length(completions, **kw):
        calls["n"] += 1
        return [0.0] * len(completions) if calls["n"] == 1 else g.reward_len(completions)

    trainer = g.GRPOTrainer(cfg_factory(max_steps=1, **SSR), reward_funcs=[flat_then_length])
    m = trainer.train_step()
    assert m["generation_retries"] == 1 and m["skipped"] == 0 and m["buffer_size"] > 0
    assert m["frac_reward_zero_std"] < 1.0  # averaged over both batches, not just the lucky one
    assert m["frac_reward_zero_std"] >= 0.5


# --- SSR through the real loop: what is buffered, drawn and trained ---------------------------------------------------


def test_every_nonzero_sample_of_every_group_is_buffered(cfg_factory, monkeypatch):
    cfg = cfg_factory(per_device_train_batch_size=16, num_generations=4, max_steps=4, **SSR)  # 4 groups a batch
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
    # replace, TRL's replay pull request's design, whose draws this test follows
    cfg = cfg_factory(**SSR, ssr_mode="replace", ssr_age_decay=0.0, gradient_accumulation_steps=2, max_steps=3)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
    spy = Spy(trainer, monkeypatch)
    for _ in range(3):
        trainer.train_step()
    assert len(spy.trained) == 3 * 2
    assert [[id(s) for s in mb] for mb in spy.trained] == [[id(s) for s in mb] for mb in spy.drawn]
    assert all(float(s["advantages"]) != 0 for mb in spy.trained for s in mb)


def test_ssr_is_really_on_it_prefers_large_advantages(cfg_factory, monkeypatch):
    """If SSR were silently off (uniform draws), trained |A| would match the buffer's mean |A|; it must exceed it."""
    # replace, TRL's replay pull request's design, whose draws this test follows
    cfg = cfg_factory(**SSR, ssr_mode="replace", ssr_age_decay=0.0, max_steps=12, ssr_alpha=2.0)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
    Spy(trainer, monkeypatch)
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
    # replace, TRL's replay pull request's design, whose draws this test follows
    cfg = cfg_factory(**SSR, ssr_mode="replace", ssr_age_decay=0.0, max_steps=4, epsilon=0.01, learning_rate=1e-2)
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
    replayed = [s["step"] < trainer.step - 1 for s in spy.trained[-1]]  # generated before the step just taken
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


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_fill_trains_every_fresh_nonzero_sample_in_the_step_that_made_it(cfg_factory, monkeypatch, num_iterations):
    """ssr_mode fill: every fresh non-zero sample trains in its batch's step(s), every time; buffer draws take
    exactly the slots of the zero-advantage ones. (In replace mode, or with SSR off, this fails.)"""
    accum, steps = 2, 6
    cfg = cfg_factory(
        **SSR, ssr_mode="fill", gradient_accumulation_steps=accum, num_iterations=num_iterations, max_steps=steps
    )
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
        assert trained[: len(keep)] == keep, "every fresh non-zero sample trains, in the step that made it"
        draws = [s for d in spy.drawn[drawn_before:] for s in d]
        assert trained[len(keep) :] == draws and len(draws) == len(zero)  # draws fill the zero slots, only them
        assert len(trained) == cfg.generation_batch_size and m["frac_zero_adv_trained"] == 0.0
        nonzero_seen, zero_seen = nonzero_seen + len(keep), zero_seen + len(zero)
    assert len(spy.generated) == steps // num_iterations  # the cadence: one batch per num_iterations steps
    assert nonzero_seen > 0 and zero_seen > 0


@pytest.mark.parametrize("mode", ["replace", "fill"])
def test_max_age_no_trained_sample_is_older_than_k(cfg_factory, monkeypatch, mode):
    ages = {}
    for max_age in (None, 1):
        cfg = cfg_factory(**SSR, ssr_mode=mode, ssr_max_age=max_age, max_steps=10, output_dir=f"{max_age}")
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

    cfg = cfg_factory(**SSR, ssr_mode="fill", ssr_max_age=0, max_steps=5)
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
        cfg = cfg_factory(
            replay_buffer_class=buffer, ssr_mode=mode, max_steps=6, learning_rate=1e-2, output_dir=f"{buffer}-{mode}"
        )
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


# --- the update: a non-finite loss, and the learning-rate schedule ----------------------------------------------------


def test_nonfinite_loss_skips_the_step_and_keeps_the_weights(cfg_factory, monkeypatch, capsys):
    trainer = g.GRPOTrainer(cfg_factory())
    real = g.grpo_loss

    def poisoned(*args, **kw):
        loss, stats = real(*args, **kw)
        return loss * float("nan"), stats

    before = [p.detach().clone() for p in trainer.model.parameters()]
    monkeypatch.setattr(g, "grpo_loss", poisoned)
    m = trainer.train_step()
    assert m["nonfinite_steps"] == 1 and m["skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert "non-finite" in capsys.readouterr().err
    monkeypatch.setattr(g, "grpo_loss", real)
    m = trainer.train_step()
    assert m["skipped"] == 0 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_warmup_matches_hf_linear_schedule(cfg_factory):
    from transformers import get_linear_schedule_with_warmup

    trainer = g.GRPOTrainer(cfg_factory(max_steps=10, warmup_steps=4))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = get_linear_schedule_with_warmup(opt, 4, 10)
    assert [trainer.scheduler.lr_lambdas[0](s) for s in range(10)] == pytest.approx(
        [f(s) for s in range(10) for f in hf.lr_lambdas]
    )
    assert trainer.scheduler.get_last_lr()[0] == 0.0  # the first step trains at learning rate 0, as HF's


# --- the baselines replay is compared with: plain GRPO, dynamic sampling, empty steps skipped -------------------------


@pytest.mark.parametrize("num_iterations,accum", [(1, 1), (2, 2), (3, 1)])
def test_uniform_buffer_reproduces_plain_grpo(cfg_factory, monkeypatch, num_iterations, accum):
    """With --replay_buffer_class ReplayBuffer every sample is trained on exactly num_iterations times."""
    cfg = cfg_factory(
        replay_buffer_class="ReplayBuffer",
        num_iterations=num_iterations,
        gradient_accumulation_steps=accum,
        max_steps=2 * num_iterations,
    )
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


def test_dynamic_sampling_trains_only_groups_with_spread_and_fills_the_batch(cfg_factory, monkeypatch):
    cfg = cfg_factory(
        replay_buffer_class="ReplayBuffer",
        dynamic_sampling=True,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_generation_retries=5,
        max_steps=4,
    )
    trainer = g.GRPOTrainer(cfg, reward_funcs=[group_gated_reward])
    step, generated, trained = spy_training(trainer, monkeypatch)
    for _ in range(4):
        m = step()
        batches, micro = generated[-1], trained[-1]
        assert 1 <= len(batches) <= 1 + cfg.max_generation_retries
        assert m["generation_retries"] == len(batches) - 1
        groups = [b[i : i + 4] for b in batches for i in range(0, len(b), 4)]
        spread = [grp for grp in groups if any(float(s["advantages"]) != 0 for s in grp)]
        flat = [s for mb in micro for s in mb]
        assert [s["uid"] for s in flat] == [s["uid"] for grp in spread[:4] for s in grp]  # the first 4, in order
        assert len(flat) == cfg.generation_batch_size and m["frac_batch_filled"] == 1.0
        assert m["groups_dropped"] == len(groups) - 4
        for i in range(0, len(flat), 4):  # every trained group has spread
            assert len({float(s["advantages"]) for s in flat[i : i + 4]}) > 1
        assert len(trainer.buffer) == 0  # no replay


def test_dynamic_sampling_respects_the_cap_and_trains_a_part_batch(cfg_factory, monkeypatch):
    cfg = cfg_factory(
        replay_buffer_class="ReplayBuffer",
        dynamic_sampling=True,
        per_device_train_batch_size=16,
        num_generations=4,
        max_generation_retries=0,
        max_steps=4,
    )
    trainer = g.GRPOTrainer(cfg, reward_funcs=[mostly_gated_reward])
    step, generated, trained = spy_training(trainer, monkeypatch)
    part = 0
    for _ in range(4):
        m = step()
        assert len(generated[-1]) == 1 and m["generation_retries"] == 0
        with_spread = sum(any(float(s["advantages"]) != 0 for s in generated[-1][0][i : i + 4]) for i in (0, 4, 8, 12))
        part += 0 < with_spread < 4
        assert sum(len(mb) for mb in trained[-1]) == 4 * with_spread
        assert m["frac_batch_filled"] == with_spread / 4 and m["groups_dropped"] == 4 - with_spread
    assert part > 0, "some step trained a part batch"


def test_dynamic_sampling_with_no_spread_generates_to_the_cap_then_skips(cfg_factory, monkeypatch):
    cfg = cfg_factory(replay_buffer_class="ReplayBuffer", dynamic_sampling=True, max_generation_retries=2, max_steps=2)
    trainer = g.GRPOTrainer(cfg, reward_funcs=[constant_reward])
    step, generated, trained = spy_training(trainer, monkeypatch)
    m = step()
    assert len(generated[-1]) == 3 and trained[-1] == [] and m["skipped"] == 1
    assert m["generation_retries"] == 2 and m["completions"] == 3 * cfg.generation_batch_size  # every batch made


def test_dynamic_sampling_needs_the_uniform_buffer(cfg_factory):
    with pytest.raises(g.ConfigError) as e:
        g.validate_config(cfg_factory(dynamic_sampling=True, **SSR))
    assert str(e.value) == "--dynamic_sampling is a baseline without replay: use --replay_buffer_class ReplayBuffer"
    g.validate_config(cfg_factory(dynamic_sampling=True))  # the default buffer is the uniform one


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
        cfg = cfg_factory(
            replay_buffer_class="ReplayBuffer",
            skip_empty_steps=skip,
            max_steps=4,
            weight_decay=weight_decay,
            learning_rate=1e-3,
        )
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


# --- notebook 05 runs one train_step by hand: its cells (tagged "by-hand") must give train_step's update --------------

NOTEBOOK = ROOT / "notebooks" / "05_one_step_by_hand.ipynb"


def by_hand_cells() -> list[str]:
    nb = json.loads(NOTEBOOK.read_text())
    return [
        "".join(c["source"])
        for c in nb["cells"]
        if c["cell_type"] == "code" and "by-hand" in c["metadata"].get("tags", [])
    ]


def run_by_hand(tmp_path, replace: tuple[str, str] | None = None) -> dict:
    """Execute the notebook's by-hand cells (optionally with one piece of code replaced); return the namespace."""
    import grpo_ssr

    namespace = {"grpo_ssr": grpo_ssr, "torch": torch, "TMP": tmp_path, "print": lambda *a, **k: None}
    threads = torch.get_num_threads()
    try:
        for source in by_hand_cells():
            if replace is not None:
                source = source.replace(*replace)
            exec(compile(source, str(NOTEBOOK), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    return namespace


def weight_difference(ns: dict) -> float:
    torch.set_rng_state(ns["rng_before"][0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the walk ran (the tiny model's trainer takes one thread): sums in the same order
    try:
        ns["twin"].train_step()
    finally:
        torch.set_num_threads(threads)
    return max(
        (p - q).abs().max().item() for p, q in zip(ns["trainer"].model.parameters(), ns["twin"].model.parameters())
    )


def test_notebook_has_the_walk():
    calls = "\n".join(by_hand_cells())
    for name in (
        "generate_batch",
        "buffer.add",
        "buffer.sample",
        "repad",
        "combine_tensor_dict",
        "per_token_logps",
        "grpo_loss",
        "backward",
        "clip_grad_norm_",
        "optimizer.step",
        "scheduler.step",
    ):
        assert name in calls, f"the by-hand cells of {NOTEBOOK.name} do not call {name}"
    assert "train_step" not in calls, "the by-hand walk must not call train_step itself"


@pytest.mark.slow
def test_hand_run_step_equals_train_step(tmp_path):
    ns = run_by_hand(tmp_path)
    assert ns["moved"] > 0  # the step did change the weights
    assert weight_difference(ns) <= 1e-7


@pytest.mark.slow
def test_the_comparison_notices_a_missing_stage(tmp_path):
    """Normalise each micro-batch by its own tokens instead of the step's (bnpo's rule, not dapo's): the weights then
    differ, so the comparison can fail."""
    dapo = "num_items_in_batch=step_tokens"
    assert dapo in "\n".join(by_hand_cells())
    ns = run_by_hand(tmp_path, replace=(dapo, "num_items_in_batch=own_tokens[i]"))
    assert weight_difference(ns) > 1e-6


# --- pinned runs: a refactor proves it changed nothing (2026-12-01) ---------------------------------------------------

# "default" is SSR's defaults (fill, age decay 2), the file's default when these were pinned
CONFIGS = {
    "default": {**SSR},
    "replace": {**SSR, "ssr_mode": "replace"},
    "uniform": {"replay_buffer_class": "ReplayBuffer", "num_iterations": 2, "gradient_accumulation_steps": 2},
    "beta": {**SSR, "beta": 0.04},
}


# Steps 2 and 4 of 4 (max_steps 4, the default settings otherwise, one torch thread), as the file computed them
# before it was split into Part I and Part II. The tolerance allows another CPU's rounding, not another algorithm.
PINNED = {
    "default": [
        {
            "step": 2,
            "reward": -36.8125,
            "loss": 0.26086071133613586,
            "grad_norm": 0.22699512541294098,
            "clip_ratio": 0.0,
        },
        {"step": 4, "reward": -31.5, "loss": 0.42624497413635254, "grad_norm": 0.31557130813598633, "clip_ratio": 0.0},
    ],
    "replace": [
        {
            "step": 2,
            "reward": -36.875,
            "loss": 0.2549920380115509,
            "grad_norm": 0.6532236337661743,
            "clip_ratio": 0.008998875506222248,
        },
        {
            "step": 4,
            "reward": -29.5,
            "loss": 0.05086508020758629,
            "grad_norm": 0.8097429871559143,
            "clip_ratio": 0.03999999910593033,
        },
    ],
    "uniform": [
        {
            "step": 2,
            "reward": -32.5,
            "loss": 0.20628806203603745,
            "grad_norm": 0.2737736403942108,
            "clip_ratio": 0.0381755605340004,
        },
        {
            "step": 4,
            "reward": -34.3125,
            "loss": 0.16192282736301422,
            "grad_norm": 0.25281813740730286,
            "clip_ratio": 0.0,
        },
    ],
    "beta": [
        {
            "step": 2,
            "reward": -36.8125,
            "loss": 0.26100727915763855,
            "grad_norm": 0.2271357625722885,
            "clip_ratio": 0.0,
            "kl": 0.003663630923256278,
        },
        {
            "step": 4,
            "reward": -31.5625,
            "loss": 0.4269564747810364,
            "grad_norm": 0.31309646368026733,
            "clip_ratio": 0.0,
            "kl": 0.008115451782941818,
        },
    ],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_runs_match_the_pinned_lines(tmp_path, name):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = g.GRPOConfig(output_dir=str(tmp_path / name), max_steps=4, eval_steps=0, device="cpu", **CONFIGS[name])
        rows = g.GRPOTrainer(cfg).train()
    finally:
        torch.set_num_threads(threads)
    for pinned in PINNED[name]:
        row = rows[pinned["step"] - 1]
        for key, value in pinned.items():
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, pinned["step"], key)


# --- old log-probs from the first training forward ---------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        dict(**SSR),
        dict(**SSR, gradient_accumulation_steps=2),
        dict(replay_buffer_class="ReplayBuffer", num_iterations=2, gradient_accumulation_steps=2),
    ],
    ids=["fill", "fill-ga2", "uniform-mu2"],
)
def test_old_logps_from_the_first_training_forward_equal_a_separate_forward(cfg_factory, flags):
    """Where every sample is trained in its own step first, the separate old-log-prob forward at generation is
    skipped and the first training forward's values are stored instead: they equal it, to float tolerance."""
    trainer = g.GRPOTrainer(
        cfg_factory(max_steps=5, per_device_train_batch_size=8, num_generations=4, **flags),
        reward_funcs=[group_gated_reward],
    )
    separate, forwards, real_gen, real_logps = {}, [], trainer.generate_batch, trainer.completion_logps

    def counting_logps(model, batch):
        forwards.append(torch.is_grad_enabled())  # no_grad inside generate_batch, grad in training
        return real_logps(model, batch)

    def generate_batch():
        samples = real_gen()
        assert all(s["old_per_token_logps"] is None for s in samples)
        with torch.no_grad():  # what the skipped forward would give, at the weights that sampled the batch
            logps = real_logps(trainer.model, g.combine_tensor_dict(samples))
        separate.update({s["uid"]: (row, s["completion_mask"].bool()) for s, row in zip(samples, logps)})
        return samples

    trainer.completion_logps, trainer.generate_batch = counting_logps, generate_batch
    checked, replayed = 0, 0
    for _ in range(5):
        m = trainer.train_step()
        replayed += m["replay_frac"] > 0
        held = [s for s in trainer.buffer.slots if s is not None]
        for s in held:
            assert s["old_per_token_logps"] is not None, "a buffered sample was never given its old log-probs"
            row, mask = separate[s["uid"]]
            torch.testing.assert_close(s["old_per_token_logps"][mask], row[mask], rtol=1e-5, atol=1e-5)
            assert (s["old_per_token_logps"][~mask] == 0).all()
            checked += 1
    assert all(forwards), "no old-log-prob forward at generation"
    assert checked > 0 and (replayed > 0 or flags.get("replay_buffer_class") == "ReplayBuffer")


def test_replace_mode_still_computes_old_logps_at_generation(cfg_factory):
    trainer = g.GRPOTrainer(cfg_factory(**SSR, ssr_mode="replace", max_steps=1), reward_funcs=[group_gated_reward])
    assert all(s["old_per_token_logps"] is not None for s in trainer.generate_batch())
