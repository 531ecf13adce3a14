"""One optimizer step through the real loop: four configurations pinned to what they computed before the file was
restructured (2026-12-01), so that a refactor proves it changed nothing."""
import pytest
import torch

import grpo_ssr as g

CONFIGS = {"default": {}, "replace": {"ssr_mode": "replace"},
           "uniform": {"replay_buffer_class": "ReplayBuffer", "num_iterations": 2, "gradient_accumulation_steps": 2},
           "beta": {"beta": 0.04}}
# Steps 2 and 4 of 4 (max_steps 4, the default settings otherwise, one torch thread), as the file computed them
# before it was split into Part I and Part II. The tolerance allows another CPU's rounding, not another algorithm.
PINNED = {
    'default': [
        {'step': 2, 'reward': -36.8125, 'loss': 0.26086071133613586, 'grad_norm': 0.22699512541294098, 'clip_ratio': 0.0},
        {'step': 4, 'reward': -31.5, 'loss': 0.42624497413635254, 'grad_norm': 0.31557130813598633, 'clip_ratio': 0.0},
    ],
    'replace': [
        {'step': 2, 'reward': -36.875, 'loss': 0.2549920380115509, 'grad_norm': 0.6532236337661743, 'clip_ratio': 0.008998875506222248},
        {'step': 4, 'reward': -29.5, 'loss': 0.05086508020758629, 'grad_norm': 0.8097429871559143, 'clip_ratio': 0.03999999910593033},
    ],
    'uniform': [
        {'step': 2, 'reward': -32.5, 'loss': 0.20628806203603745, 'grad_norm': 0.2737736403942108, 'clip_ratio': 0.0381755605340004},
        {'step': 4, 'reward': -34.3125, 'loss': 0.16192282736301422, 'grad_norm': 0.25281813740730286, 'clip_ratio': 0.0},
    ],
    'beta': [
        {'step': 2, 'reward': -36.8125, 'loss': 0.26100727915763855, 'grad_norm': 0.2271357625722885, 'clip_ratio': 0.0, 'kl': 0.003663630923256278},
        {'step': 4, 'reward': -31.5625, 'loss': 0.4269564747810364, 'grad_norm': 0.31309646368026733, 'clip_ratio': 0.0, 'kl': 0.008115451782941818},
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

def gated_reward(completions, prompts, **kw):
    """Length reward for half of the prompts, a constant for the other half: fill mode then draws from the buffer."""
    return [0.0 if ("cooking" in p or "running" in p) else -abs(20 - len(c)) for c, p in zip(completions, prompts)]


@pytest.mark.parametrize("flags", [dict(), dict(gradient_accumulation_steps=2),
                                   dict(replay_buffer_class="ReplayBuffer", num_iterations=2,
                                        gradient_accumulation_steps=2)], ids=["fill", "fill-ga2", "uniform-mu2"])
def test_old_logps_from_the_first_training_forward_equal_a_separate_forward(cfg_factory, flags):
    """Where every sample is trained in its own step first, the separate old-log-prob forward at generation is
    skipped and the first training forward's values are stored instead: they equal it, to float tolerance."""
    trainer = g.GRPOTrainer(cfg_factory(max_steps=5, per_device_train_batch_size=8, num_generations=4, **flags),
                            reward_funcs=[gated_reward])
    assert trainer.old_from_training
    separate, forwards, real_gen, real_logps = {}, [], trainer.generate_batch, trainer._logps

    def counting_logps(logprobs, batch):
        forwards.append(torch.is_grad_enabled())  # no_grad inside generate_batch, grad in training
        return real_logps(logprobs, batch)

    def generate_batch():
        samples = real_gen()
        assert all(s["old_per_token_logps"] is None for s in samples)
        with torch.no_grad():  # what the skipped forward would give, at the weights that sampled the batch
            logps = real_logps(trainer.logprobs, g.combine_tensor_dict(samples))
        separate.update({s["uid"]: (row, s["completion_mask"].bool()) for s, row in zip(samples, logps)})
        return samples

    trainer._logps, trainer.generate_batch = counting_logps, generate_batch
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
    trainer = g.GRPOTrainer(cfg_factory(ssr_mode="replace", max_steps=1), reward_funcs=[gated_reward])
    assert not trainer.old_from_training
    assert all(s["old_per_token_logps"] is not None for s in trainer.generate_batch())
