"""Rewards and advantages (Part I, 2-3, and Part II's scoring): the reward functions by hand, group advantages and zero
spread, scale_rewards (group, batch, none, and TRL's True and False), resolving reward functions, and scoring a batch
(weights, None and NaN, errors that name the function)."""

import math
import warnings

import pytest
import torch

import grpo_ssr as g
from conftest import SMALL, error_line, scripted_sampler, training_rows

# --- the reward functions ---------------------------------------------------------------------------------------------


def test_reward_len_hand_values():
    assert g.reward_len(["a" * 20, "a" * 5, "a" * 31, ""]) == [0.0, -15.0, -11.0, -20.0]
    chat = [[{"role": "assistant", "content": "x" * 18}]]
    assert g.reward_len(chat) == [-2.0]
    assert g.reward_len_binary(["a" * 18, "a" * 22, "a" * 17, "a" * 23]) == [1.0, 1.0, 0.0, 0.0]


REWARD_CASES = [  # (completion, answer, reward)
    ("12", 12, 1.0),
    (" 12.", 12, 1.0),  # a full stop ends the number
    ("The answer is 12.", 12, 1.0),
    ("12\nBecause 7 + 5 = 12", 12, 1.0),  # only the first number counts
    ("7 + 5 = 12", 12, 0.0),  # restating the question is not answering it
    ("10 11 12 13 14 15", 12, 0.0),  # listing numbers until one is right is not rewarded
    ("11, 12 or 13", 12, 0.0),
    ("120", 12, 0.0),
    ("12.5", 12, 0.0),
    ("12.0", 12, 1.0),
    ("-3", -3, 1.0),
    ("twelve", 12, 0.0),
    ("", 12, 0.0),
    ("The answer is 5", "5", 1.0),  # an answer column of strings works too
]


def test_reward_accuracy_on_hand_written_completions():
    completions = [c for c, _, _ in REWARD_CASES]
    answers = [a for _, a, _ in REWARD_CASES]
    assert g.reward_accuracy(completions, answer=answers) == [r for _, _, r in REWARD_CASES]
    chat = [[{"role": "assistant", "content": c}] for c in completions]  # what a chat prompt's completions look like
    assert g.reward_accuracy(chat, answer=answers, prompts=None) == [r for _, _, r in REWARD_CASES]
    assert g.REWARD_FUNCS["reward_accuracy"] is g.reward_accuracy


# --- group advantages and zero spread ---------------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    # group 1: mean 3, unbiased std sqrt(((-2)^2 + 1 + 0 + 9) / 3) = sqrt(14/3); group 2: no spread
    std = math.sqrt(14 / 3)
    expected = torch.tensor([-2 / (std + 1e-4), -1 / (std + 1e-4), 0.0, 3 / (std + 1e-4), 0, 0, 0, 0])
    assert torch.allclose(g.group_advantages(rewards, 4, scale_rewards=True), expected, atol=1e-6)
    unscaled = g.group_advantages(rewards, 4, scale_rewards=False)
    assert unscaled.tolist() == [-2.0, -1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    assert g.zero_spread_groups(rewards, 4).tolist() == [False, True]


def test_zero_spread_advantage_is_exactly_zero():
    # 0.1 * 3 is not exactly representable: a naive r - mean(r) leaves rounding residue; we promise exact zeros.
    rewards = torch.full((6,), 0.1)
    adv = g.group_advantages(rewards, 3, scale_rewards=True)
    assert (adv == 0).all()


def test_unscorable_rewards_are_left_out_of_the_group_statistics():
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 3.0, 8.0, nan, nan, nan, nan, 2.0, nan, 2.0, 5.0])
    adv = g.group_advantages(rewards, 4, scale_rewards=True)
    # group 1: scored 1, 3, 8: mean 4, unbiased std sqrt((9 + 1 + 16) / 2) = sqrt(13); the NaN gets exactly 0
    s = math.sqrt(13) + 1e-4
    assert adv[:4].tolist() == pytest.approx([-3 / s, 0.0, -1 / s, 4 / s], abs=1e-6)
    assert adv[1] == 0 and (adv[4:8] == 0).all()  # a group with nothing scored teaches nothing
    s = math.sqrt(3) + 1e-4  # group 3: scored 2, 2, 5: mean 3, unbiased std sqrt((1 + 1 + 4) / 2)
    assert adv[8:].tolist() == pytest.approx([-1 / s, 0.0, -1 / s, 2 / s], abs=1e-6)
    assert g.zero_spread_groups(rewards, 4).tolist() == [False, True, False]
    assert g.zero_spread_groups(torch.tensor([nan, 1.0, 1.0, nan]), 4).tolist() == [True]


def test_scale_rewards_batch_by_hand_and_trls_words():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 8.0, 5.0, 5.0, 5.0, 5.0])
    # group means 2.5, 2 and 5; "batch" divides every group's centred rewards by one std, the whole batch's
    # (unbiased): mean 38/12, sum of squared deviations 73.6667, std sqrt(73.6667 / 11) = 2.587850
    mean = 38 / 12
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards.tolist()) / 11)
    assert std == pytest.approx(2.587850, abs=1e-6)
    centred = [-1.5, -0.5, 0.5, 1.5, -2.0, -2.0, -2.0, 6.0, 0.0, 0.0, 0.0, 0.0]
    batch = g.group_advantages(rewards, 4, "batch")
    assert torch.allclose(batch, torch.tensor([c / (std + 1e-4) for c in centred]), atol=1e-6)
    assert (batch[8:] == 0).all()  # a group with no spread stays exactly 0
    # True is "group" and False is "none", bit for bit
    assert torch.equal(g.group_advantages(rewards, 4, True), g.group_advantages(rewards, 4, "group"))
    assert torch.equal(g.group_advantages(rewards, 4, False), g.group_advantages(rewards, 4, "none"))
    assert g.group_advantages(rewards, 4, "none").tolist() == centred
    assert [g.GRPOConfig(scale_rewards=v).scale_rewards for v in (True, False, "none", "batch")] == [
        "group",
        "none",
        "none",
        "batch",
    ]


def test_scale_rewards_from_the_cli_and_through_a_step(cfg_factory, capsys, keep_threads):
    words = {"none": "none", "group": "group", "batch": "batch", "true": "group", "false": "none"}
    for word, meant in words.items():
        assert g.parse_cli(["--scale_rewards", word])[0].scale_rewards == meant
    assert g.main(["--no_scale_rewards", *SMALL]) == 2  # TRL's bool flag is gone: --scale_rewards none
    assert error_line(capsys) == (
        "error: --no_scale_rewards is not a field of GRPOConfig (python grpo_ssr.py --help "
        "lists them); did you mean --scale_rewards?"
    )
    assert g.main(["--scale_rewards", "sometimes", *SMALL]) == 2
    assert "--scale_rewards 'sometimes' is invalid" in error_line(capsys)
    trainer = g.GRPOTrainer(cfg_factory(scale_rewards="batch"))
    samples = trainer.generate_batch()
    rewards = torch.tensor(
        [
            float(
                g.reward_len(
                    [
                        trainer.tokenizer.decode(
                            s["completion_ids"][s["completion_mask"].bool()], skip_special_tokens=True
                        )
                    ]
                )[0]
            )
            for s in samples
        ]
    )
    expected = g.group_advantages(rewards, 4, "batch")
    assert torch.allclose(torch.stack([s["advantages"] for s in samples]), expected, atol=1e-5)


# --- resolving the reward functions, and scoring a batch --------------------------------------------------------------


def test_dotted_reward_path_from_the_cli(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text(
        "def shortest(completions, **kw):\n    return [-float(len(c)) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "o"
    assert g.main(["--reward_funcs", "my_rewards.shortest,reward_len", "--output_dir", str(out), *SMALL]) == 0
    rows = training_rows(out)
    assert "rewards/shortest" in rows[0] and "rewards/reward_len" in rows[0]
    capsys.readouterr()
    assert g.main(["--reward_funcs", "no_such_module.f", "--output_dir", str(tmp_path / "p"), *SMALL]) == 2
    line = error_line(capsys)
    assert "--reward_funcs 'no_such_module.f' could not be imported" in line and "No module named" in line


def test_reward_functions_receive_completion_ids(cfg_factory, monkeypatch):
    seen = {}

    def by_tokens(completions, completion_ids, **kw):
        seen["ids"], seen["texts"] = completion_ids, completions
        return [float(len(ids)) for ids in completion_ids]

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[by_tokens])
    scripted_sampler(monkeypatch, [0, 3, 99, 5], trainer.tokenizer.eos_token_id, other=ord("a"))
    samples = trainer.generate_batch()
    eos = trainer.tokenizer.eos_token_id
    assert [len(i) for i in seen["ids"][:4]] == [1, 4, 16, 6]  # padding removed; a sampled EOS ends the list
    assert seen["ids"][1] == [97, 97, 97, eos] and seen["texts"][1] == "aaa"
    assert all(isinstance(t, int) for ids in seen["ids"] for t in ids)
    assert [s["completion_mask"].sum().item() for s in samples[:4]] == [1, 4, 16, 6]


def test_weighted_reward_functions(cfg_factory):
    calls = []

    def const(v):
        def f(completions, **kw):
            calls.append(v)
            return [v] * len(completions)

        f.__name__ = f"const_{v}"
        return f

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[const(1.0), const(3.0)], reward_weights=[2.0, 0.5])
    samples = trainer.generate_batch()
    assert trainer.generation_metrics["reward"] == pytest.approx(2.0 * 1.0 + 0.5 * 3.0)
    assert trainer.generation_metrics["rewards/const_3.0"] == 3.0
    assert all(float(s["advantages"]) == 0.0 for s in samples)


@pytest.mark.parametrize("weights", [[1.0, "a"], [1.0], "12"])
def test_reward_weights_passed_to_the_trainer_must_be_one_number_a_function(cfg_factory, weights):
    with pytest.raises(g.ConfigError) as e:
        g.GRPOTrainer(cfg_factory(), reward_funcs=[g.reward_len, g.reward_len_binary], reward_weights=weights)
    assert str(e.value) == f"--reward_weights {weights!r} is invalid: give 2 number(s), one per reward function"


def test_nan_and_none_rewards_are_no_score(cfg_factory):
    def patchy(completions, **kw):
        return [math.nan if i % 4 == 0 else (None if i % 4 == 1 else 1.0) for i in range(len(completions))]

    def length(completions, **kw):
        return [float(len(c)) for c in completions]

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[patchy, length], reward_weights=[10.0, 1.0])
    samples = trainer.generate_batch()
    lens = torch.tensor(
        [
            float(
                len(
                    trainer.tokenizer.decode(s["completion_ids"][s["completion_mask"].bool()], skip_special_tokens=True)
                )
            )
            for s in samples
        ]
    )
    expected = lens + torch.tensor([0.0 if i % 4 < 2 else 10.0 for i in range(8)])
    assert trainer.generation_metrics["reward"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert trainer.counters["reward_nan"] == 4
    m = trainer.train_step()
    assert math.isfinite(m["loss"]) and m["reward_nan"] == 8


def test_unscorable_completions_get_nan_reward_zero_advantage_and_are_never_replayed(cfg_factory):
    def every_fourth_unscored(completions, **kw):
        return [None if i % 4 == 0 else -abs(20 - len(c)) for i, c in enumerate(completions)]

    def also_none_there(completions, **kw):
        return [math.nan if i % 4 == 0 else 0.0 for i in range(len(completions))]

    trainer = g.GRPOTrainer(
        cfg_factory(max_steps=2, replay_buffer_class="SSRReplayBuffer"),
        reward_funcs=[every_fourth_unscored, also_none_there],
    )
    with pytest.warns(UserWarning, match="every_fourth_unscored"):
        samples = trainer.generate_batch()
    texts = [
        trainer.tokenizer.decode(s["completion_ids"][s["completion_mask"].bool()], skip_special_tokens=True)
        for s in samples
    ]
    rewards = torch.tensor([math.nan if i % 4 == 0 else -abs(20 - len(t)) for i, t in enumerate(texts)])
    assert trainer.generation_metrics["reward"] == pytest.approx(rewards.nanmean().item(), rel=1e-5)
    assert trainer.generation_metrics["frac_reward_unscorable"] == 0.25
    adv = torch.stack([s["advantages"] for s in samples])
    assert (adv[::4] == 0).all()
    for grp in range(2):
        scored = rewards[grp * 4 + 1 : grp * 4 + 4]
        if scored.max() > scored.min():
            expected = (scored - scored.mean()) / (scored.std() + 1e-4)
            assert torch.allclose(adv[grp * 4 + 1 : grp * 4 + 4], expected, atol=1e-5)
    trainer.buffer.add(samples)
    held = {s["uid"] for s in trainer.buffer.slots if s is not None}
    assert not held & {samples[i]["uid"] for i in range(0, 8, 4)}


def test_all_none_batch_says_so_when_the_step_is_skipped(cfg_factory, capsys):
    def never_scores(completions, **kw):
        return [None] * len(completions)

    trainer = g.GRPOTrainer(
        cfg_factory(max_generation_retries=1, replay_buffer_class="SSRReplayBuffer"), reward_funcs=[never_scores]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = trainer.train_step()
        trainer.train_step()
    assert m["skipped"] == 1 and m["frac_reward_unscorable"] == 1.0 and len(trainer.buffer) == 0
    err = capsys.readouterr().err.splitlines()
    why = "no group had reward spread, or a score, after 1 retries"
    assert err == [f"warning: step {n} skipped: {why}" for n in (1, 2)], err
    assert sum("never_scores" in str(w.message) for w in caught) == 1  # warned once, over 4 batches
    assert trainer.reward_funcs[0].func is never_scores and trainer.reward_funcs[0].warned


def test_reward_returning_wrong_count_names_the_function(cfg_factory):
    def short_reward(completions, **kw):
        return [0.0] * (len(completions) - 1)

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[short_reward])
    with pytest.raises(g.ConfigError) as e:
        trainer.train_step()
    assert str(e.value) == (
        "reward function 'short_reward' returned [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] for 8 "
        "completions: return one finite number (or None) per completion"
    )

    def wordy_reward(completions, **kw):
        return ["good"] * len(completions)

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[wordy_reward])
    with pytest.raises(g.ConfigError) as e:
        trainer.train_step()
    shown = str(["good"] * 8)[:60]  # the first 60 characters of what it returned
    assert shown == "['good', 'good', 'good', 'good', 'good', 'good', 'good', 'go"
    assert str(e.value) == (
        f"reward function 'wordy_reward' returned {shown} for 8 completions: return one finite "
        "number (or None) per completion"
    )


def test_infinite_reward_is_an_error_naming_the_function(cfg_factory):
    def explosive(completions, **kw):
        return [math.inf] + [0.0] * (len(completions) - 1)

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[explosive])
    with pytest.raises(ValueError, match=r"'explosive' returned \[inf, 0.0, .* one finite number"):
        trainer.train_step()


def test_a_reward_that_returns_strings_is_refused_naming_it(cfg_factory, keep_threads):
    def quoted(completions, **kw):
        return ["1"] * len(completions)

    trainer = g.GRPOTrainer(cfg_factory(), reward_funcs=[quoted])
    with pytest.raises(g.ConfigError) as e:  # float("1") would take it: a bug, not a score
        trainer.generate_batch()
    assert str(e.value) == (
        "reward function 'quoted' returned ['1', '1', '1', '1', '1', '1', '1', '1'] for 8 "
        "completions: return one finite number (or None) per completion"
    )
