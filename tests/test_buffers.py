"""Replay buffers and repad (Part I, 4): split and combine, repad, the uniform and the SSR buffer by hand and
statistically (fixed seeds), the age decay and the age limit, state dicts, and make_buffer."""

import numpy as np
import pytest
import torch

import grpo_ssr as g

# --- split, combine and repad -----------------------------------------------------------------------------------------

PAD = 0


def _sample(prompt, p_mask, comp, c_mask, old=None, ref=None, adv=1.0):
    t = lambda x, dt=torch.long: torch.tensor(x, dtype=dt)
    return {
        "prompt_ids": t(prompt),
        "prompt_mask": t(p_mask),
        "completion_ids": t(comp),
        "completion_mask": t(c_mask),
        "old_per_token_logps": None if old is None else t(old, torch.float),
        "ref_per_token_logps": None if ref is None else t(ref, torch.float),
        "advantages": t(adv, torch.float),
    }


def test_split_then_combine_round_trip():
    batch = {
        "prompt_ids": torch.arange(6).view(3, 2),
        "advantages": torch.tensor([1.0, 2.0, 3.0]),
        "old_per_token_logps": None,
        "uid": [10, 11, 12],
    }
    samples = g.split_tensor_dict(batch)
    assert len(samples) == 3 and samples[1]["prompt_ids"].tolist() == [2, 3] and samples[2]["uid"] == 12
    assert samples[0]["old_per_token_logps"] is None
    back = g.combine_tensor_dict(samples)
    assert torch.equal(back["prompt_ids"], batch["prompt_ids"]) and back["uid"] == [10, 11, 12]
    assert back["old_per_token_logps"] is None


def test_repad_trims_and_pads_hand_example():
    a = _sample([0, 0, 5, 6], [0, 0, 1, 1], [7, 8, 2, 0], [1, 1, 1, 0], old=[-1, -2, -3, -9])
    b = _sample([0, 4, 5, 6], [0, 1, 1, 1], [9, 0, 0, 0], [1, 0, 0, 0], old=[-4, -9, -9, -9])
    out = g.repad([a, b], PAD)
    assert out[0]["prompt_ids"].tolist() == [0, 5, 6] and out[0]["prompt_mask"].tolist() == [0, 1, 1]
    assert out[1]["prompt_ids"].tolist() == [4, 5, 6] and out[1]["prompt_mask"].tolist() == [1, 1, 1]
    assert out[0]["completion_ids"].tolist() == [7, 8, 2] and out[0]["completion_mask"].tolist() == [1, 1, 1]
    assert out[1]["completion_ids"].tolist() == [9, 0, 0] and out[1]["completion_mask"].tolist() == [1, 0, 0]
    assert out[0]["old_per_token_logps"].tolist() == [-1, -2, -3]
    assert out[1]["old_per_token_logps"].tolist() == [-4, 0, 0]
    assert out[0]["ref_per_token_logps"] is None
    assert out[0]["advantages"].item() == 1.0  # other keys pass through


def test_repad_all_zero_mask_becomes_all_padding():
    a = _sample([3, 4], [1, 1], [5, 6, 7], [1, 1, 1], old=[-1, -1, -1], ref=[-2, -2, -2])
    b = _sample([0, 4], [0, 1], [8, 8, 8], [0, 0, 0], old=[-5, -5, -5], ref=[-6, -6, -6])
    out = g.repad([a, b], PAD)
    assert out[1]["completion_ids"].tolist() == [0, 0, 0]
    assert out[1]["completion_mask"].tolist() == [0, 0, 0]
    assert out[1]["old_per_token_logps"].tolist() == [0, 0, 0]
    assert out[1]["ref_per_token_logps"].tolist() == [0, 0, 0]


def test_repad_already_tight_is_identity():
    a = _sample([3, 4], [1, 1], [5, 6], [1, 1], old=[-1, -2])
    b = _sample([0, 4], [0, 1], [8, 0], [1, 0], old=[-3, 0])
    out = g.repad([a, b], PAD)
    for before, after in zip([a, b], out):
        for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_per_token_logps"):
            assert torch.equal(before[k], after[k]), k


# --- the uniform buffer and the SSR buffer ----------------------------------------------------------------------------


def _items(advs):
    return [{"uid": i, "advantages": torch.tensor(float(a))} for i, a in enumerate(advs)]


def test_uniform_buffer_fifo_and_exact_iterations():
    buf = g.ReplayBuffer(capacity=8, seed=0)
    buf.add(_items(range(8)))
    # two passes of 4 micro-batches of 2: each sample exactly twice (num_iterations = 2)
    drawn = [s["uid"] for _ in range(8) for s in buf.sample(2)]
    assert sorted(drawn) == sorted(list(range(8)) * 2)
    buf.add([{"uid": 100, "advantages": torch.tensor(0.0)}, {"uid": 101, "advantages": torch.tensor(0.0)}])
    held = {s["uid"] for s in buf.slots}
    assert held == {2, 3, 4, 5, 6, 7, 100, 101}  # the two oldest were evicted
    assert len(buf) == 8


def test_uniform_buffer_keeps_zero_advantages_and_refuses_overdraw():
    buf = g.ReplayBuffer(capacity=4)
    buf.add(_items([0, 0, 1]))
    assert len(buf) == 3 and not buf.can_sample(4)
    with pytest.raises(ValueError, match="cannot draw 4"):
        buf.sample(4)


def test_ssr_rejects_zero_advantage_and_counts_it():
    buf = g.SSRReplayBuffer(capacity=10, alpha=1.0)
    buf.add(_items([0.0, 1.0, -2.0, 0.0, 0.5]))
    assert len(buf) == 3 and buf.rejected == 2
    assert {s["uid"] for s in buf.slots if s is not None} == {1, 2, 4}
    draws = [s["uid"] for s in buf.sample(2000)]
    assert not {0, 3} & set(draws)


def test_ssr_fifo_eviction_keeps_priorities_aligned():
    buf = g.SSRReplayBuffer(capacity=3, alpha=1.0, seed=0)
    buf.add(_items([1.0, 2.0, 3.0]))
    buf.add([{"uid": 9, "advantages": torch.tensor(100.0)}])  # evicts uid 0
    assert {s["uid"] for s in buf.slots} == {1, 2, 9}
    counts = np.bincount([s["uid"] for s in buf.sample(4000)], minlength=10)
    assert counts[0] == 0 and counts[9] > 0.9 * 4000  # 100 / 105 of the mass


def test_ssr_empty_raises_clear_error():
    buf = g.SSRReplayBuffer(capacity=4)
    buf.add(_items([0.0, 0.0]))
    assert not buf.can_sample(1)
    with pytest.raises(ValueError, match="empty"):
        buf.sample(1)


# Chi-square critical values at p = 0.001 (from tables) for K - 1 = 7 degrees of freedom.
CHI2_CRIT_7DOF = 24.32


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0])
def test_ssr_draws_follow_abs_advantage_power_alpha(alpha):
    advs = [0.1, -0.3, 0.5, -0.8, 1.0, 1.3, -2.0, 2.5]
    buf = g.SSRReplayBuffer(capacity=16, alpha=alpha, seed=1234)
    buf.add(_items(advs + [0.0, 0.0]))  # the zeros are rejected, never drawn
    n = 40_000
    counts = np.bincount([s["uid"] for s in buf.sample(n)], minlength=10)
    assert counts[8] == counts[9] == 0
    target = np.abs(advs) ** alpha
    target = target / target.sum()
    assert _chi2(counts[:8], target) < CHI2_CRIT_7DOF
    assert np.allclose(buf.probabilities().numpy(), target)
    # the test has power: the same counts are far from the distribution of a different alpha
    other = np.abs(advs) ** (alpha + 1.0)
    assert _chi2(counts[:8], other / other.sum()) > 10 * CHI2_CRIT_7DOF


def test_effective_sample_size():
    buf = g.SSRReplayBuffer(capacity=8, alpha=1.0)
    buf.add(_items([1.0, 1.0, 1.0, 1.0]))
    assert g.effective_sample_size(buf) == pytest.approx(4.0)
    buf.add(_items([100.0]))
    assert g.effective_sample_size(buf) < 1.2
    uniform = g.ReplayBuffer(capacity=8)  # the uniform buffer's draws are worth its size
    uniform.add(_items([1.0, 0.0, 100.0]))
    assert g.effective_sample_size(uniform) == pytest.approx(3.0)
    assert g.effective_sample_size(g.SSRReplayBuffer(capacity=4)) == 0.0  # empty: nothing to draw


def _checkpoint_round_trip(buf, copy):
    """What save_checkpoint and load_checkpoint do with a buffer: vars(buffer) less the generator, whose state is
    saved beside it (buffer_generator), through torch.save and torch.load."""
    import io

    blob = io.BytesIO()
    torch.save(
        {
            "buffer": {k: v for k, v in vars(buf).items() if k != "generator"},
            "buffer_generator": buf.generator.get_state(),
        },
        blob,
    )
    blob.seek(0)
    own = torch.load(blob, weights_only=False)
    assert "generator" not in own["buffer"]
    vars(copy).update(own["buffer"])
    copy.generator.set_state(own["buffer_generator"])


def test_buffer_state_dict_round_trip():
    buf = g.SSRReplayBuffer(capacity=4, alpha=1.0, seed=3)
    buf.add(_items([1.0, 0.0, 2.0, 3.0, 4.0]))
    copy = g.SSRReplayBuffer(capacity=4, alpha=1.0, seed=99)
    _checkpoint_round_trip(buf, copy)
    assert [s["uid"] for s in buf.sample(50)] == [s["uid"] for s in copy.sample(50)]
    assert copy.rejected == 1 and len(copy) == 4
    uniform = g.ReplayBuffer(capacity=4, seed=3)  # mid-queue: the rest of its permutation carries over
    uniform.add(_items([1.0, 0.0, 2.0, 3.0]))
    uniform.sample(1)
    copy = g.ReplayBuffer(capacity=4, seed=99)
    _checkpoint_round_trip(uniform, copy)
    draws = lambda b: [s["uid"] for s in b.sample(3) + b.sample(4)]
    assert draws(uniform) == draws(copy)


# --- ages: the decayed priority and the age limit (arXiv 2604.16918 and 2606.04560) -----------------------------------

CHI2_CRIT_3DOF = 16.27  # p = 0.001, 3 degrees of freedom


AGED_ADVS = [1.0, -2.0, 0.5, 3.0, -1.0, 2.0, 1.5, -0.5]


AGED_STEPS = [0, 0, 1, 1, 2, 2, 3, 3]


def _aged_items(advs=AGED_ADVS, steps=AGED_STEPS, first_uid=0):
    return [
        {"uid": first_uid + i, "advantages": torch.tensor(a), "step": s} for i, (a, s) in enumerate(zip(advs, steps))
    ]


def test_ssr_draws_follow_the_age_decayed_priority():
    """P(i) ~ |A_i| * exp(-age_i / tau), with tau = 2 and the clock at step 3: ages 3, 3, 2, 2, 1, 1, 0, 0."""
    buf = g.SSRReplayBuffer(capacity=16, alpha=1.0, seed=7, age_decay=2.0)
    buf.add(_aged_items())
    buf.advance_to(3)
    e = np.exp
    target = np.array(
        [1.0 * e(-1.5), 2.0 * e(-1.5), 0.5 * e(-1.0), 3.0 * e(-1.0), 1.0 * e(-0.5), 2.0 * e(-0.5), 1.5, 0.5]
    )
    target = target / target.sum()
    assert np.allclose(buf.probabilities().numpy(), target)
    counts = np.bincount([s["uid"] for s in buf.sample(40_000)], minlength=8)
    assert _chi2(counts, target) < CHI2_CRIT_7DOF
    plain = np.abs(AGED_ADVS) / np.abs(AGED_ADVS).sum()  # power: the undecayed |A| is told apart
    assert _chi2(counts, plain) > 10 * CHI2_CRIT_7DOF
    assert g.effective_sample_size(buf) == pytest.approx(1 / (target**2).sum())


def test_ssr_age_limit_evicts_and_never_draws_old_samples():
    buf = g.SSRReplayBuffer(capacity=16, alpha=1.0, seed=3, max_age=1)
    buf.add(_aged_items())
    buf.advance_to(2)  # ages 2, 2, 1, 1, 0, 0, -, -: the two of step 0 go
    assert len(buf) == 6 and {s["uid"] for s in buf.slots if s is not None} == {2, 3, 4, 5, 6, 7}
    buf.advance_to(3)  # now step 1 is too old as well
    assert len(buf) == 4
    counts = np.bincount([s["uid"] for s in buf.sample(20_000)], minlength=8)
    assert counts[:4].sum() == 0
    target = np.array([1.0, 2.0, 1.5, 0.5]) / 5.0  # |A| of steps 2 and 3
    assert np.allclose(buf.probabilities().numpy(), target)
    assert _chi2(counts[4:], target) < CHI2_CRIT_3DOF
    buf.advance_to(10)  # everything is too old: nothing to draw, a clear error
    assert len(buf) == 0 and not buf.can_sample(1)
    with pytest.raises(ValueError, match="too old"):
        buf.sample(1)


def test_ssr_age_limit_holds_for_samples_added_out_of_step_order():
    """Eviction leaves from the tail, so a too-old sample behind a younger one stays stored; it is still never drawn."""
    buf = g.SSRReplayBuffer(capacity=8, alpha=1.0, seed=5, max_age=1)
    buf.add(_aged_items([1.0, 5.0, 2.0], [3, 0, 3]))
    buf.advance_to(3)
    assert len(buf) == 3
    counts = np.bincount([s["uid"] for s in buf.sample(5_000)], minlength=3)
    assert counts[1] == 0 and counts[0] > 0 and counts[2] > 0
    assert np.allclose(buf.probabilities().numpy(), [1 / 3, 0.0, 2 / 3])


def test_ssr_ring_stays_aligned_after_eviction_and_wrap():
    """Eviction frees the tail of the ring; later adds wrap around it and FIFO eviction still drops the oldest."""
    buf = g.SSRReplayBuffer(capacity=4, alpha=1.0, seed=0, max_age=1)
    buf.add(_aged_items([1.0, 2.0, 3.0], [0, 0, 1]))
    buf.advance_to(2)  # uids 0, 1 evicted; uid 2 (step 1) stays
    buf.add(_aged_items([10.0, 20.0, 40.0], [2, 2, 2], first_uid=10))  # wraps: slots 3, 0, 1
    assert len(buf) == 4
    assert np.allclose(buf.probabilities().numpy(), np.array([3.0, 10.0, 20.0, 40.0]) / 73.0)  # oldest first
    buf.add(_aged_items([80.0], [2], first_uid=20))  # full: FIFO evicts uid 2, the oldest
    assert {s["uid"] for s in buf.slots} == {10, 11, 12, 20}
    assert np.allclose(buf.probabilities().numpy(), np.array([10.0, 20.0, 40.0, 80.0]) / 150.0)
    counts = np.bincount([s["uid"] for s in buf.sample(20_000)], minlength=21)[[10, 11, 12, 20]]
    assert _chi2(counts, np.array([10.0, 20.0, 40.0, 80.0]) / 150.0) < CHI2_CRIT_3DOF


def test_aged_buffer_state_dict_round_trip():
    buf = g.SSRReplayBuffer(capacity=16, alpha=1.0, seed=3, max_age=2, age_decay=1.5)
    buf.add(_aged_items())
    buf.advance_to(3)
    copy = g.SSRReplayBuffer(capacity=16, alpha=1.0, seed=99, max_age=2, age_decay=1.5)
    _checkpoint_round_trip(buf, copy)
    assert copy.clock == 3 and len(copy) == len(buf) == 6
    assert torch.equal(copy.probabilities(), buf.probabilities())
    assert [s["uid"] for s in buf.sample(50)] == [s["uid"] for s in copy.sample(50)]


# --- make_buffer ------------------------------------------------------------------------------------------------------


def test_short_aliases_select_the_same_buffers(cfg_factory):
    assert type(g.make_buffer(cfg_factory(replay_buffer_class="ssr"))) is g.SSRReplayBuffer
    assert type(g.make_buffer(cfg_factory(replay_buffer_class="uniform"))) is g.ReplayBuffer
    cfg = cfg_factory(replay_buffer_class="SSRReplayBuffer")
    assert g.make_buffer(cfg).capacity == cfg.generation_batch_size * cfg.ssr_capacity_scalar
    default = g.make_buffer(cfg_factory())  # the default: plain GRPO, one generation batch
    assert type(default) is g.ReplayBuffer and default.capacity == cfg.generation_batch_size
