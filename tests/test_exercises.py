"""The exercises' checks (notebooks/course/checks.py): each accepts its solution (notebooks/course/solutions/), rejects
a wrong answer with one line and a hint, and reports an unanswered one as such; and every check is used by a
notebook."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "notebooks" / "course"), str(ROOT / "notebooks" / "study")]

import solutions  # noqa: E402
from solutions import nb02, nb03, nb04, nb06, nb08, nb09, nb10, study01  # noqa: E402

import checks  # noqa: E402
import grpo_ssr  # noqa: E402


def _plain_mean_baseline(rewards, num_generations):  # forgets to leave the sample out
    g = rewards.view(-1, num_generations)
    return (g - g.mean(1, keepdim=True)).view(-1)


def _unpaired_bootstrap(arm, baseline, n_boot=10_000, seed=0):  # resamples the two arms' seeds independently
    rng = np.random.default_rng(seed)
    pick = lambda x: x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1)
    means = pick(np.asarray(arm)) - pick(np.asarray(baseline))
    return float(np.mean(arm) - np.mean(baseline)), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _interval_of_the_seeds(arm, baseline, n_boot=10_000, seed=0):  # percentiles of the differences, not of the mean
    d = np.asarray(arm) - np.asarray(baseline)
    return float(d.mean()), float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))


def _all_wrong_share(completions, answers, num_generations, reward_func=grpo_ssr.reward_accuracy):
    rewards = torch.tensor(reward_func(completions=completions, answer=answers)).view(-1, num_generations)
    return (rewards.max(1).values == 0).float().mean().item()  # forgets the groups that are all right


class _IgnoresItsRule(nb09.RankReplayBuffer):  # declares rank-based draws, but draws as SSR does, P ~ |A|
    _weights = grpo_ssr.SSRReplayBuffer._weights


def _constant_reward(completions, **kwargs):  # never varies: every group has zero spread
    return [1.0] * len(completions)


def _population_std_advantages(rewards, num_generations):  # std with ddof 0, not TRL's unbiased one
    g = rewards.view(-1, num_generations)
    adv = (g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + 1e-4)
    return torch.where(grpo_ssr.zero_spread_groups(rewards, num_generations)[:, None], 0.0, adv).view(-1)


def _loss_without_mask(logps, old, adv, mask, loss_type, step_tokens, step_sequences, epsilon=0.2):  # pads count
    return nb10.my_loss(logps, old, adv, torch.ones_like(mask), loss_type, step_tokens, step_sequences, epsilon)


def _ssr_without_empty_slots(advantages, ages, filled, alpha, age_decay):  # an empty slot keeps its stale weight
    return nb10.my_ssr_probabilities(advantages, ages, torch.ones_like(filled), alpha, age_decay)


def _step(temperature_one=False, clip=True, old_after=False, zero=True, detach=True):
    """nb10.my_train_step with one mistake (the keywords name it)."""

    def step(model, optimizer, micro_batches, cfg):
        T = 1.0 if temperature_one else cfg.temperature
        graph = torch.no_grad if detach else torch.enable_grad
        with graph():
            old = [nb10.my_logps(model, mb, T) for mb in micro_batches]
        tokens = sum(mb["completion_mask"].sum() for mb in micro_batches)
        sequences = sum(len(mb["advantages"]) for mb in micro_batches)
        for _ in range(cfg.num_iterations):
            if old_after:  # taken again from the weights being trained: after an update, not the sampler's
                with graph():
                    old = [nb10.my_logps(model, mb, T) for mb in micro_batches]
            for mb, old_logps in zip(micro_batches, old):
                logps = nb10.my_logps(model, mb, T)
                args = (mb["advantages"], mb["completion_mask"], cfg.loss_type, tokens, sequences, cfg.epsilon)
                nb10.my_loss(logps, old_logps, *args).backward(retain_graph=not detach)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            if zero:
                optimizer.zero_grad()
        return []

    return step


WRONG = {
    "01.1": 11,  # characters, not bytes
    "01.2": [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]],  # kept the second EOS
    "01.3": (0.6652, 0.9999),  # softmax(logits) at T = 1 for the first
    "02.1": 0.7**4,  # forgot the all-success groups
    "02.2": _plain_mean_baseline,
    "03.1": ((1.5, 1.0), (-1.5, -1.0)),  # ignored the clip
    "03.2": 1.0,  # log pi - log pi_ref, the k1 term
    "03.3": lambda x, mask, dim=None: (x * mask).mean() if dim is None else (x * mask).mean(dim),  # pads counted
    "03.4": lambda losses, masks: [(l * m).sum() / m.sum() / len(masks) for l, m in zip(losses, masks)],  # bnpo
    "04.1": (0.5, 0.5),
    "04.2": (3.0, 3.0),
    "04.3": lambda adv, age, alpha, tau: nb04.aged_probabilities(adv, age * 0, alpha, tau),  # no decay
    "06.1": (5, 5),  # read both rules as "anywhere"
    "06.2": grpo_ssr.extract_answer,  # the lenient first number: "7 + 5 = 12" gives 7
    "06.3": _all_wrong_share,
    "08.1": 0.0,  # "the loss is 0": the lengths weigh the advantages
    "08.2": lambda logits, k: 1 / torch.softmax(logits, -1).topk(k, -1).values.sum(-1),  # pi_sampler / pi
    "08.3": (1.728, 0.075),  # the population std (ddof 0), not TRL's unbiased one
    "09.1": _plain_mean_baseline,  # the group mean includes the sample itself
    "09.2": _IgnoresItsRule,
    "09.3": _constant_reward,
    "10.1": _population_std_advantages,
    "10.2": _loss_without_mask,
    "10.3": _ssr_without_empty_slots,
    "10.4": _step(detach=False),  # the old log-probs keep their graph: logp - old has gradient 0
    "S01.1": _unpaired_bootstrap,
    "S01.2": (0.962, 3.372),  # sample_age over those steps: age is not distance
    "01.Q": {1: (16, 24), 2: "c", 3: -6},  # the pair swapped
    "02.Q": {1: "c", 2: 3, 3: "a"},  # NaN for a zero-spread group
    "03.Q": {1: (1, 0), 2: "b", 3: "b"},  # bnpo divides by each micro-batch's tokens, not the step's
    "04.Q": {1: 0.75, 2: 1, 3: 6},  # each sample once, whatever num_iterations
    "05.Q": {1: 8, 2: 1, 3: "b"},  # one micro-batch, not the generation batch
    "06.Q": {1: "b", 2: 1, 3: "c"},  # the reward, not the advantage
    "07.Q": {1: "a", 2: "b", 3: "a"},  # the full logits
    "08.Q": {1: "c", 2: "a", 3: "a"},  # a clipped token at the first iteration is not normal
    "10.Q": {1: 1, 2: "b", 3: 30},  # the micro-batch's own tokens
}


@pytest.mark.parametrize(
    "wrong",
    [_interval_of_the_seeds, (0.0632, 0.0574), (0.015288, 0.018906)],
    ids=["percentiles of the differences", "whole run", "swapped"],
)
def test_study_checks_reject_other_mistakes(wrong):
    with pytest.raises(checks.NotYet, match="not yet"):
        checks.check("S01.1" if callable(wrong) else "S01.2", wrong)


def _all_in_the_first(losses, masks):  # the right sum, but the first micro-batch carries every token's loss
    total = sum((loss * mask).sum() for loss, mask in zip(losses, masks)) / sum(mask.sum() for mask in masks)
    return [total] + [torch.zeros(())] * (len(losses) - 1)


def _naive_aged_probabilities(adv, age, alpha, tau):  # |A| ** alpha with no special case: 0 ** 0 is 1
    priority = adv.abs().double() ** alpha * torch.exp(-age.double() / tau)
    return priority / priority.sum()


@pytest.mark.parametrize(
    "exercise, wrong, hint",
    [
        ("03.4", _all_in_the_first, "own tokens' losses, each divided by the token count of the whole step"),
        ("04.3", _naive_aged_probabilities, "With alpha = 0, |0| ** 0 is 1"),
    ],
    ids=["03.4 all in the first micro-batch", "04.3 zero to the power zero"],
)
def test_checks_catch_the_answers_that_pass_a_weaker_check(exercise, wrong, hint):
    """03.4 once tested only the sum of the micro-batch losses, and 04.3 never tried alpha = 0 with a zero advantage:
    these two answers passed. Now each fails with its hint, while the solution passes."""
    with pytest.raises(checks.NotYet, match=f"^exercise {exercise}: not yet: ") as raised:
        checks.check(exercise, wrong)
    assert hint in str(raised.value)
    assert checks.check(exercise, solutions.ANSWERS[exercise]) is True


def _loo_for_groups_of_four(rewards, num_generations):  # right on the hand-made groups of 4, wrong in the step (8)
    return nb09.loo_advantages(rewards, 4)


def _loo_with_rounding(rewards, num_generations):  # no special case: a flat group keeps a rounding error, not 0
    grouped = rewards.view(-1, num_generations)
    return (grouped - (grouped.sum(1, keepdim=True) - grouped) / (num_generations - 1)).view(-1)


class _DrawsEmptySlots(nb09.RankReplayBuffer):  # the rule on the held samples, but a little weight on empty slots
    def _weights(self):
        return super()._weights() + 1e-3 * torch.tensor([s is None for s in self.slots], dtype=torch.float64)


class _TurnsNothingAway(nb09.RankReplayBuffer):  # stores zero advantages too
    def add(self, samples):
        for s in samples:
            self._store(s)


class _UniformOverSlots(nb09.RankReplayBuffer):  # declares "uniform over the held samples", draws by slot weights
    @staticmethod
    def expected_probabilities(advantages):
        return torch.full((len(advantages),), 1 / len(advantages), dtype=torch.float64)

    def _weights(self):  # the right rule on a probe whose slots are contiguous, but weighs by |A| after training
        held = torch.tensor([s is not None for s in self.slots], dtype=torch.float64)
        return held if len(self) <= 4 else grpo_ssr.SSRReplayBuffer._weights(self)


def _noise_reward(completions, **kwargs):  # varies, but says nothing about the completion: nothing to learn
    generator = _noise_reward.generator
    return torch.rand(len(completions), generator=generator).tolist()


_noise_reward.generator = torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    "exercise, wrong, hint",
    [
        ("09.1", _loo_for_groups_of_four, "It should work for any group size G"),  # 02.2's check, run first
        ("09.1", _loo_with_rounding, "must get exactly 0"),
        ("09.2", _DrawsEmptySlots, "0 for an empty slot"),
        ("09.2", _TurnsNothingAway, "must turn away the two zeros"),
        ("09.2", _UniformOverSlots, "must give each slot the weight your rule gives its sample"),
        pytest.param("09.3", _noise_reward, "did not go up by 3 times the noise", marks=pytest.mark.slow),
    ],
    ids=[
        "09.1 G fixed at 4",
        "09.1 rounding",
        "09.2 empty slots",
        "09.2 zeros kept",
        "09.2 rule not followed",
        "09.3 noise",
    ],
)
def test_notebook_09_checks_catch_what_trains_wrong(exercise, wrong, hint):
    """The mistakes a hands-on exercise invites: each fails with its own hint (most of them only through the step)."""
    with pytest.raises(checks.NotYet, match=f"^exercise {exercise}: not yet: ") as raised:
        checks.check(exercise, wrong)
    assert hint in str(raised.value)


def test_notebook_09_checks_leave_the_thread_count_alone():
    threads = torch.get_num_threads()
    checks.check("09.1", solutions.ANSWERS["09.1"])
    assert torch.get_num_threads() == threads


def _float_reader(text):  # float() after whitespace and one final period: reads "1e1", "nan", "１２" as numbers
    text = text.strip()
    try:
        return float(text[:-1] if text.endswith(".") else text)
    except ValueError:
        return None


def _any_script_digits(text):  # the strict pattern with \d: Python's re matches full-width digits with it
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\.?\s*", text)
    return float(match.group(1)) if match else None


def _strict_but_for(case):  # the solution, except that it reads one text with float()
    return lambda text: float(text) if text == case else nb06.strict_answer(text)


@pytest.mark.parametrize(
    "wrong, text, got",
    [
        (_float_reader, "1e1", "10.0"),
        (_any_script_digits, "１２", "12.0"),
        (_strict_but_for("1e1"), "1e1", "10.0"),
        (_strict_but_for("nan"), "nan", "nan"),
        (_strict_but_for("１２"), "１２", "12.0"),
    ],
    ids=["float()", "re's \\d", "only 1e1", "only nan", "only full-width 12"],
)
def test_strict_reader_check_rejects_what_float_reads(wrong, text, got):
    """06.2 once accepted a float()-based reader: it gives 10 for "1e1", nan for "nan" and 12 for "１２". Each of
    these readers now fails on the first text it reads as a number, with the hint that names float()'s extras; the
    solution (digits [0-9], not \\d) passes."""
    with pytest.raises(checks.NotYet, match="^exercise 06.2: not yet: ") as raised:
        checks.check("06.2", wrong)
    assert f"strict_answer({text!r}) gave {got}, expected None" in str(raised.value)
    assert "float() reads more than a number written out" in str(raised.value)
    assert checks.check("06.2", nb06.strict_answer) is True
    assert all(nb06.strict_answer(text) is None for text in checks.NOT_WRITTEN_OUT)


@pytest.mark.parametrize(
    "wrong, name",
    [
        (grpo_ssr.reward_len, "reward_len"),
        (grpo_ssr.reward_len_binary, "reward_len_binary"),
        (lambda completions, **kwargs: grpo_ssr.reward_len(completions), "reward_len"),
        (lambda completions, **kwargs: [r / 20 + 1 for r in grpo_ssr.reward_len(completions)], "reward_len"),
        (lambda completions, **kwargs: [2 * r for r in grpo_ssr.reward_len_binary(completions)], "reward_len_binary"),
    ],
    ids=["reward_len itself", "reward_len_binary itself", "wrapped", "shifted and scaled", "binary doubled"],
)
def test_own_reward_check_rejects_a_built_in_reward(wrong, name):
    """09.3 asks for a reward of your own: grpo_ssr's rewards fail, by identity or by what they give on a probe (also
    shifted or rescaled, which gives the same advantages), before any training, with a hint that names them; a
    reward that grades another length (-|10 - length|, an idea the notebook gives) is not mistaken for one."""
    with pytest.raises(checks.NotYet, match="^exercise 09.3: not yet: ") as raised:
        checks.check("09.3", wrong)
    assert f"that is grpo_ssr's {name} " in str(raised.value) and "a reward of your own" in str(raised.value)
    assert checks._built_in_reward(nb09.reward_lowercase) is None
    assert checks._built_in_reward(lambda completions, **kwargs: [-abs(10 - len(c)) for c in completions]) is None


def _quiz_message(exercise, answers):
    with pytest.raises(checks.NotYet, match=f"^exercise {exercise}: not yet: ") as raised:
        checks.check(exercise, answers)
    return str(raised.value)


@pytest.mark.parametrize("exercise", sorted(checks.QUIZZES))
def test_self_check_cannot_be_found_one_option_at_a_time(exercise):
    """A self-check gives one verdict: whichever answers are wrong (any one, or all), it says the same line, with
    every question's hint. So trying the options of one question while another is wrong finds nothing (02.Q's
    answers were once found in four tries, each naming the first wrong question). A missing answer is named; the
    right answers, as a dict or in order, pass."""
    right = solutions.ANSWERS[exercise]
    assert checks.check(exercise, right) is True and checks.check(exercise, list(right.values())) is True
    everything_wrong = _quiz_message(exercise, {number: "z" for number in right})
    for _, hint in checks.QUIZZES[exercise]:
        assert hint in everything_wrong
    for number in right:  # one wrong answer, at each place in turn
        assert _quiz_message(exercise, {**right, number: "z"}) == everything_wrong
    # trying every option of question 1, the right one included, while question 2 is wrong: nothing changes
    options = ["a", "b", "c", "d", right[1], 0, 1]
    assert {_quiz_message(exercise, {**right, 1: option, 2: "z"}) for option in options} == {everything_wrong}
    assert "has no answer yet" in _quiz_message(exercise, {k: v for k, v in right.items() if k < len(right)})


def test_the_first_wrong_question_is_not_named():
    """The old message began "question 1: got ..." for a wrong first answer: no message names a question now."""
    message = _quiz_message("02.Q", {1: "c", 2: 3, 3: "a"})  # 02.Q's wrong answer: NaN for a zero-spread group
    assert message.startswith("exercise 02.Q: not yet: not all 3 answers are right yet") and "got" not in message


# the exercises answered by a number or numbers (not a function, not a self-check)
VALUES = sorted(e for e in checks.CHECKS if e not in checks.QUIZZES and not callable(solutions.ANSWERS[e]))


def _significant(text: str) -> int:
    return len(text.lstrip("-0.").replace(".", "").rstrip("0") if "e" not in text else text)


@pytest.mark.parametrize("exercise", VALUES)
def test_no_reference_answer_is_written_in_the_checks(exercise):
    """A number answer is compared with a hash, or with a value computed when the check runs: neither the answer nor
    any rounding of it to 3 to 8 significant digits is in checks.py (numbers of fewer digits, such as 0.5 or 12, are
    everywhere in code and are not looked for)."""
    source = Path(checks.__file__).read_text()
    answer = solutions.ANSWERS[exercise]
    values = np.asarray(answer, dtype=np.float64).flatten()
    if (values != values.round()).any():  # whole numbers (01.1, 01.2, 06.1) are hashed, yet "12" is in any code
        assert str(answer) not in source
    for value in values:
        for digits in range(3, 9):
            text = f"{value:.{digits}g}"
            if _significant(text) >= 3:
                assert text not in source, f"{exercise}: {text} is written in checks.py"


@pytest.mark.parametrize("exercise, width", [("01.3", 1e-4), ("03.1", 1e-6), ("04.2", 1e-3), ("S01.2", 5e-4)])
def test_a_hashed_number_keeps_its_tolerance(exercise, width):
    """_near_hash passes every answer within its width of the reference and fails every one more than twice it away,
    number by number."""
    answer = np.asarray(solutions.ANSWERS[exercise], dtype=np.float64)
    for moved in (0.9 * width, -0.9 * width):
        assert checks.check(exercise, (answer + moved).tolist()) is True
    for index in range(answer.size):
        for moved in (2.1 * width, -2.1 * width):
            off = answer.flatten().copy()
            off[index] += moved
            with pytest.raises(checks.NotYet):
                checks.check(exercise, off.reshape(answer.shape).tolist())


def _advantages_without_epsilon(rewards, num_generations):  # / std, without TRL's + 1e-4
    g = rewards.view(-1, num_generations)
    adv = (g - g.mean(1, keepdim=True)) / g.std(1, keepdim=True)
    return torch.where(grpo_ssr.zero_spread_groups(rewards, num_generations)[:, None], 0.0, adv).view(-1)


def _advantages_counting_nan(rewards, num_generations):  # an unscorable completion counted as a reward of 0
    return nb10.my_advantages(rewards.nan_to_num(0.0), num_generations)


def _advantages_not_exactly_zero(rewards, num_generations):  # no special case: a flat group keeps a rounding error
    g = rewards.view(-1, num_generations)
    return ((g - g.nanmean(1, keepdim=True)) / (grpo_ssr.nanstd(g, 1) + 1e-4)).nan_to_num(0.0).view(-1)


def _loss_max(logps, old, adv, mask, loss_type, step_tokens, step_sequences, epsilon=0.2):  # min and max swapped
    m = mask.to(logps.dtype)
    ratio = torch.where(mask.bool(), logps - old, 0.0).exp()
    per_token = -torch.max(ratio * adv[:, None], ratio.clamp(1 - epsilon, 1 + epsilon) * adv[:, None]) * m
    if loss_type == "dapo":
        return per_token.sum() / step_tokens
    return (per_token.sum(1) / m.sum(1).clamp(min=1)).sum() / step_sequences


def _dapo_per_micro_batch(logps, old, adv, mask, loss_type, step_tokens, step_sequences, epsilon=0.2):
    return nb10.my_loss(logps, old, adv, mask, loss_type, mask.sum(), len(adv), epsilon)  # its own tokens, sequences


def _grpo_over_tokens(logps, old, adv, mask, loss_type, step_tokens, step_sequences, epsilon=0.2):
    return nb10.my_loss(logps, old, adv, mask, "dapo", step_tokens, step_sequences, epsilon)  # a token mean


def _ssr_decay_sign(advantages, ages, filled, alpha, age_decay):  # exp(+age / age_decay): the old weigh most
    return nb10.my_ssr_probabilities(advantages, -ages, filled, alpha, age_decay)


def _ssr_alpha_ignored(advantages, ages, filled, alpha, age_decay):
    return nb10.my_ssr_probabilities(advantages, ages, filled, 1.0, age_decay)


@pytest.mark.parametrize(
    "exercise, wrong, hint",
    [
        ("10.1", _population_std_advantages, "that is the population std"),
        ("10.1", _advantages_without_epsilon, "std + 1e-4"),
        ("10.1", _advantages_counting_nan, "leave a NaN reward out of its group's mean and std"),
        ("10.1", _advantages_not_exactly_zero, "must get exactly 0"),
        ("10.2", _loss_without_mask, "the padded tokens count: multiply by the completion mask"),
        ("10.2", _loss_max, "you took the max, which clips the wrong side"),
        ("10.2", _dapo_per_micro_batch, "dapo divides each micro-batch's summed token losses by the token count"),
        ("10.2", _grpo_over_tokens, "grpo is a mean of per-sequence means"),
        ("10.3", _ssr_decay_sign, "the decay must favour the young"),
        ("10.3", _ssr_alpha_ignored, "use alpha"),
        ("10.3", _ssr_without_empty_slots, "an empty slot must get probability 0"),
        ("10.4", _step(detach=False), "compute them under torch.no_grad()"),
        ("10.4", _step(old_after=True), "the old log-probs must be the sampling policy's"),
        ("10.4", _step(clip=False), "clip the gradient's global norm to cfg.max_grad_norm"),
        ("10.4", _step(zero=False), "zero the gradients after each optimizer step"),
        ("10.4", _step(temperature_one=True), "divide the logits by the sampling temperature"),
    ],
    ids=[
        "10.1 population std",
        "10.1 no 1e-4",
        "10.1 NaN counted",
        "10.1 zero spread not exactly 0",
        "10.2 mask forgotten",
        "10.2 min and max swapped",
        "10.2 dapo per micro-batch",
        "10.2 grpo over tokens",
        "10.3 decay sign",
        "10.3 alpha ignored",
        "10.3 empty slots drawn",
        "10.4 old not detached",
        "10.4 old after the update",
        "10.4 no clipping",
        "10.4 no zero_grad",
        "10.4 temperature forgotten",
    ],
)
def test_notebook_10_checks_name_what_is_wrong(exercise, wrong, hint):
    """Each piece of the capstone, written one plausible wrong way: its check fails, with the hint that names it."""
    with pytest.raises(checks.NotYet, match=f"^exercise {exercise}: not yet: ") as raised:
        checks.check(exercise, wrong)
    assert hint in str(raised.value)


def test_notebook_10_step_check_is_tight_where_it_looks():
    """The solution's step moves the weights as the reference does, to within a small fraction of the tolerance the
    check allows (1e-3 of the largest move), and the clipped case really clips."""
    model, batch = checks._step_batch()
    cfg = grpo_ssr.GRPOConfig(temperature=0.7, num_iterations=2, max_grad_norm=0.01, loss_type="grpo")
    got = checks._moves(nb10.my_train_step, model, batch, 2, cfg, 10.0)
    want = checks._moves(None, model, batch, 2, cfg, 10.0)
    assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())
    unclipped = checks._moves(None, model, batch, 2, cfg, 10.0, clip=False)
    assert float((unclipped - want).abs().max()) > 0.1 * float(want.abs().max())


def test_the_two_mistakes_are_right_where_the_old_checks_looked():
    """The answers above are wrong only where the tightened checks look: their sum is the big batch's loss, and with
    alpha > 0 they agree with the solution."""
    losses = [torch.rand(2, 5), torch.rand(3, 5)]
    masks = [torch.ones(2, 5), torch.ones(3, 5)]
    assert torch.isclose(sum(_all_in_the_first(losses, masks)), sum(nb03.dapo_micro_batch_losses(losses, masks)))
    adv, age = torch.tensor([2.0, -1.0, 0.0]), torch.tensor([0.0, 1.0, 2.0])
    assert torch.allclose(_naive_aged_probabilities(adv, age, 1.0, 2.0), nb04.aged_probabilities(adv, age, 1.0, 2.0))
    assert not torch.allclose(
        _naive_aged_probabilities(adv, age, 0.0, 2.0), nb04.aged_probabilities(adv, age, 0.0, 2.0)
    )


def test_colab_fetches_every_solution():
    """Notebook 10 imports the solutions (they stand in for the exercises not answered yet): in Colab, course_setup
    must fetch every file of the solutions' folder, and nothing that is not there."""
    import course_setup

    folder = {p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks" / "course" / "solutions").glob("*.py")}
    assert set(course_setup.SOLUTION_FILES) == folder


def test_every_check_has_a_solution_and_a_wrong_answer():
    assert set(checks.CHECKS) == set(solutions.ANSWERS) == set(WRONG)


# 09.3's check trains the tiny model 30 steps to see the reward rise, a training run: in the slow lane (pytest.ini).
EXERCISES = [pytest.param(e, marks=pytest.mark.slow) if e == "09.3" else e for e in sorted(checks.CHECKS)]


@pytest.mark.parametrize("exercise", EXERCISES)
def test_check_accepts_the_solution(exercise, capsys):
    assert checks.check(exercise, solutions.ANSWERS[exercise]) is True
    assert f"exercise {exercise}: correct" in capsys.readouterr().out


@pytest.mark.parametrize("exercise", EXERCISES)
def test_check_rejects_a_wrong_answer(exercise, capsys):
    """One line that names the exercise and gives a hint; nothing printed that could read as a pass."""
    with pytest.raises(checks.NotYet, match=f"^exercise {exercise}: not yet: ") as raised:
        checks.check(exercise, WRONG[exercise])
    assert isinstance(raised.value, AssertionError)  # a script or pytest still sees a failed check
    assert raised.value._render_traceback_() == [str(raised.value)]  # what IPython shows instead of a traceback
    assert "\n" not in str(raised.value) and len(str(raised.value)) > len(f"exercise {exercise}: not yet: ") + 20
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_a_wrong_answer_shows_one_line_in_a_notebook():
    """In a kernel started as the notebooks are (cwd notebooks/), a wrong answer shows as one line with the hint and
    no traceback; the right one then passes."""
    import nbformat
    from nbclient import NotebookClient

    cells = [
        "import sys; sys.path.insert(0, 'course'); sys.path.insert(0, '..')\nimport checks",
        'checks.check("04.1", (0.5, 0.5))',
        'checks.check("04.1", (0.5, 2 / 3))',
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    ).execute()
    wrong, right = nb.cells[1].outputs, nb.cells[2].outputs
    assert [o.output_type for o in wrong] == ["error"] and wrong[0].ename == "NotYet"
    assert len(wrong[0].traceback) == 1 and "Traceback" not in wrong[0].traceback[0]
    assert wrong[0].traceback[0].startswith("exercise 04.1: not yet: got (0.5, 0.5). P(i) = ")
    assert "exercise 04.1: correct" in "".join(o.get("text", "") for o in right)


@pytest.mark.parametrize("exercise", sorted(checks.CHECKS))
def test_check_reports_an_unanswered_exercise(exercise, capsys):
    unanswered = (lambda *args, **kwargs: None) if callable(solutions.ANSWERS[exercise]) else None
    assert checks.check(exercise, unanswered) is False
    assert "not answered yet" in capsys.readouterr().out


def test_solutions_behave_beyond_the_checked_cases():
    """The solutions are the reference a teacher hands out: a few more properties than the checks test."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert torch.allclose(nb02.leave_one_out_advantages(r, 4), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    p = nb04.aged_probabilities(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0]), 1.0, 1.0)
    assert torch.allclose(p, torch.tensor([1.0, torch.e**-1.0], dtype=torch.float64) / (1 + torch.e**-1.0))
    assert nb03.masked_mean(torch.ones(2, 3), torch.zeros(2, 3), dim=1).tolist() == [0.0, 0.0]
    # the paired bootstrap agrees with the study script's own interval on the study's data (same resampling)
    import run_study

    auc = {
        (r["arm"], r["seed"]): run_study.eval_measures(r, [])["auc"] for r in study01.RUNS if r["learning_rate"] == 3e-4
    }
    arm, base = (np.array([auc[(a, s)] for s in range(8)]) for a in ("ssr_fill_decay", "grpo"))
    summary = json.loads((ROOT / "notebooks" / "study" / "results" / "replay_study" / "summary.json").read_text())
    want = summary["cells"]["0.0003"]["ssr_fill_decay"]["vs_grpo_eval"]["auc"]
    assert np.allclose(study01.paired_bootstrap(arm, base), [want["mean"], *want["ci95"]], atol=1e-5)
    assert nb06.strict_answer("\t42 ") == 42.0 and nb06.strict_answer("42 is it") is None
    chat = [[{"role": "assistant", "content": t}] for t in ("3", "4", "3", "3")]  # chat completions, as the trainer
    assert nb06.zero_spread_share(chat, [3, 3, 3, 3], 2) == 0.5  # passes them for chat prompts
    # the loss of exercise 08.1 is grpo_loss's; the top-k ratio is 1 when k is the whole vocabulary
    mask = (torch.arange(6)[None] < torch.tensor([2, 4, 4, 6])[:, None]).long()
    loss, _ = grpo_ssr.grpo_loss(
        torch.zeros(4, 6), torch.zeros(4, 6), grpo_ssr.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4), mask
    )
    assert abs(nb08.loss_8_1 - loss.item()) < 1e-6
    assert torch.allclose(nb08.first_iteration_ratio(torch.randn(3, 9), 9), torch.ones(3, dtype=torch.float64))
    # leave-one-out is GRPO's centred reward scaled by G / (G - 1); the rank rule puts ties at their best rank
    r = torch.randn(16, generator=torch.Generator().manual_seed(0))
    unscaled = grpo_ssr.group_advantages(r, 8, scale_rewards=False)
    assert torch.allclose(nb09.loo_advantages(r, 8), unscaled * 8 / 7, atol=1e-6)
    p = nb09.RankReplayBuffer.expected_probabilities(torch.tensor([2.0, -2.0, 1.0]))
    assert torch.allclose(p, torch.tensor([1.0, 1.0, 1 / 3], dtype=torch.float64) / (7 / 3))
    assert nb09.reward_lowercase(["ab", "", "A1"]) == [1.0, 0.0, 0.0]


def test_every_check_is_used_by_its_notebook():
    """Exercise NN.k is called in notebooks/NN_*.ipynb, and exercise SNN.k in notebooks/study/NN_*.ipynb."""
    used = set()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "notebooks" / "study").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        prefix = ("S" if path.parent.name == "study" else "") + path.name[:2]
        for cell in nb["cells"]:
            src = "".join(cell["source"])
            used |= {e for e in checks.CHECKS if f'checks.check("{e}"' in src and e.split(".")[0] == prefix}
    assert used == set(checks.CHECKS), f"checks no notebook calls: {sorted(set(checks.CHECKS) - used)}"


def test_self_check_answers_are_not_written_in_the_checks():
    """The self-checks compare hashes: no answer that is a word or a pair appears in checks.py."""
    source = Path(checks.__file__).read_text()
    for exercise in checks.QUIZZES:
        for value in solutions.ANSWERS[exercise].values():
            if isinstance(value, tuple):
                assert str(value) not in source and str(list(value)) not in source
