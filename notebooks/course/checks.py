"""The checks behind the notebooks' exercises: `check("02.2", your_answer)`.

A check prints whether the answer is right. A wrong answer raises NotYet, which a notebook shows as one line, "exercise
02.2: not yet: ..." with a hint, and no traceback; `None` (or a function that still returns None) means "not answered
yet". Functions are tested on hand-computed cases and properties, and the hands-on ones (09.x) through real training
steps.

No reference answer is written in this file. Number answers are compared with a hash of the reference (`_same_hash`
for whole numbers, `_near_hash` for the others: each number is put in its cell of a grid as wide as the tolerance, and
the cells are hashed), or with a value the check computes from grpo_ssr when it runs (08.1). A reader of this file
sees digests, not answers; a hash only hides an answer from reading, not from someone who hashes every candidate.

Each course notebook ends with self-check questions, `check("01.Q", {1: ..., 2: ..., 3: ...})`, compared with
hashes too. They are built so that trying the options one at a time finds nothing: every question must be answered,
the check then gives one verdict for them all, and a wrong verdict is the same line whichever answers are wrong, with
a hint for every question. The hints still teach (each says where to look or what rule to apply), but no answer to
one question changes what the check says until all are right. A quiz of multiple choices alone can still be found by
trying every combination (18 for 07.Q's three questions of 3, 2 and 3 options); that takes longer than the reading.

This folder, notebooks/course/, is the course's machinery: the solutions live in solutions/ beside this file,
course_setup.py makes the notebooks run anywhere, and tests/test_exercises.py runs every check against the solutions
and against wrong answers.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
from typing import Any, Callable
from unittest import mock

import numpy as np
import torch

import grpo_ssr


class NotYet(AssertionError):
    """A wrong answer, with a hint. IPython shows it as its one line (what `_render_traceback_` returns): a traceback
    would only show the checks' own code. It is an AssertionError, so a script or pytest sees a failed check."""

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise NotYet(message)


def _show(answer: Any) -> str:
    """An answer on one short line: a tensor or array as a list, numbers to 6 significant digits."""

    def rounded(x):
        if isinstance(x, (torch.Tensor, np.ndarray)):
            x = torch.as_tensor(x).detach().cpu().tolist()
        if isinstance(x, (list, tuple)):
            return type(x)(rounded(v) for v in x)
        return float(f"{x:.6g}") if isinstance(x, float) else x

    text = " ".join(str(rounded(answer)).split())
    return text if len(text) <= 80 else text[:77] + "..."


def _digest(value: Any) -> str:
    """A short hash of a JSON-able answer (integral floats count as ints)."""
    norm = json.loads(json.dumps(value), parse_float=lambda s: int(float(s)) if float(s).is_integer() else float(s))
    return hashlib.sha256(json.dumps(norm).encode()).hexdigest()[:16]


def _close(answer, expected, tol: float, hint: str) -> None:
    got = torch.as_tensor(answer, dtype=torch.float64).flatten()
    want = torch.as_tensor(expected, dtype=torch.float64).flatten()
    _require(got.shape == want.shape and torch.allclose(got, want, atol=tol, rtol=0), f"got {_show(answer)}. {hint}")


def _same_hash(answer, digest: str, hint: str) -> None:
    _require(_digest(answer) == digest, f"got {_show(answer)}. {hint}")


def _cells(answer, width: float) -> list[int] | None:
    """The numbers of an answer, flattened, each as the index of its cell on a grid of this width; None if it is not
    all finite numbers."""
    try:
        values = torch.as_tensor(answer, dtype=torch.float64).flatten().tolist()
        return [math.floor(v / width) for v in values]
    except (TypeError, ValueError, RuntimeError, OverflowError):  # not numbers, nan, or inf
        return None


def _near_hash(key: str, answer, digest: str, width: float, hint: str) -> None:
    """A numeric answer compared with a hash of its reference, not with the reference itself: each number is put in
    its cell of a grid of `width`, and the answer passes if its cells, each moved by at most one, hash to `digest`. So
    an answer within `width` of the reference always passes, one more than 2 * `width` away never does, and the
    digest (of the key and the reference's cells) does not show the reference to a reader of this file."""
    cells = _cells(answer, width)
    ok = cells is not None and any(
        _digest([key, [c + s for c, s in zip(cells, shift)]]) == digest
        for shift in itertools.product((-1, 0, 1), repeat=len(cells))
    )
    _require(ok, f"got {_show(answer)}. {hint}")


def _tensor_fn(fn: Callable, *args) -> torch.Tensor | None:
    out = fn(*args)
    return None if out is None else torch.as_tensor(out, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------------------------------
# 01 · generation and reward
# ----------------------------------------------------------------------------------------------------------------------


def _01_1(answer):
    _same_hash(int(answer), "6b51d431df5d7f14", "Count bytes, not characters: how many bytes is ï in UTF-8?")


def _01_2(answer):
    _same_hash(
        [[int(v) for v in row] for row in answer],
        "1dc894461d897b29",
        "Compare row by row with the rule 'up to and including the first EOS'.",
    )


def _01_3(answer):
    _near_hash(
        "01.3",
        answer,
        "030959c13b9e752d",
        1e-4,
        "softmax(logits / T): divide first, then normalise; a small T sharpens.",
    )


# ----------------------------------------------------------------------------------------------------------------------
# 02 · group advantages
# ----------------------------------------------------------------------------------------------------------------------


def _02_1(answer):
    _near_hash("02.1", answer, "32bd2eafbf0a35a1", 1e-3, "A group has zero spread when all succeed or all fail.")


def _02_2(fn):
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0])
    got = _tensor_fn(fn, r, 4)
    if got is None:
        return None
    _require(got.shape == (8,), f"expected one advantage per completion, shape (8,), got {tuple(got.shape)}")
    _close(
        got,
        [1, -1 / 3, -1 / 3, -1 / 3, 4 / 3, -4 / 3, 0, 0],
        1e-5,
        "A_i = r_i - mean of the OTHER G - 1 rewards of its group; groups are contiguous blocks of G.",
    )
    x = torch.randn(24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    unscaled = grpo_ssr.group_advantages(x, 6, scale_rewards=False)
    _close(_tensor_fn(fn, x, 6), unscaled * 6 / 5, 1e-5, "It should work for any group size G.")
    return True


# ----------------------------------------------------------------------------------------------------------------------
# 03 · the GRPO loss
# ----------------------------------------------------------------------------------------------------------------------


def _03_1(answer):
    _near_hash(
        "03.1",
        answer,
        "0cce158707851b8e",
        1e-6,
        "min(rho * A, clip(rho) * A): which branch is smaller? The clipped branch does not depend on rho.",
    )


def _03_2(answer):
    _near_hash("03.2", answer, "2f5702850fe09cda", 1e-5, "k3 = exp(d) - d - 1 with d = log pi_ref - log pi.")


def _03_3(fn):
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    got = _tensor_fn(fn, x, mask)
    if got is None:
        return None
    _close(got, 29 / 6, 1e-6, "With dim=None: the mean over every entry whose mask is 1 (here 6 of them).")
    _close(
        _tensor_fn(fn, x, mask, 1),
        [1.5, 6.5, 0.0],
        1e-6,
        "With dim=1: one mean per row; a row without any mask-1 entry gives 0, not NaN.",
    )
    return True


def _losses(values) -> torch.Tensor:
    """A list of scalar losses (tensors or floats) as one float64 tensor."""
    return torch.stack([torch.as_tensor(x, dtype=torch.float64).detach().reshape(()) for x in values])


def _03_4(fn):
    # by hand: micro-batch losses [[1, 2, (0)]] and [[3, (0), (0)], [1, 1, 1]], padding in brackets; the step has 6
    # tokens, so the micro-batches' losses are (1 + 2) / 6 and (3 + 1 + 1 + 1) / 6
    losses = [torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[3.0, 0.0, 0.0], [1.0, 1.0, 1.0]])]
    masks = [torch.tensor([[1, 1, 0]]), torch.tensor([[1, 0, 0], [1, 1, 1]])]
    got = fn(losses, masks)
    if got is None:
        return None
    _require(len(got) == 2, f"expected one loss per micro-batch (2), got {len(got)}")
    _close(
        _losses(got),
        [0.5, 1.0],
        1e-6,
        "Each micro-batch's loss holds only its own tokens' losses, each divided by the token count of the whole step.",
    )
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.1 - 2
    old = logp + torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = (torch.arange(7)[None] < torch.tensor([7, 1, 3, 5, 2, 6])[:, None]).long()
    ratio = (logp - old).exp()
    per_token_loss = -torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]) * mask
    parts = [slice(0, 2), slice(2, 6)]  # two micro-batches of unequal token counts (8 and 16)
    got = fn([per_token_loss[p] for p in parts], [mask[p] for p in parts])
    want, _ = grpo_ssr.grpo_loss(logp, old, adv, mask, loss_type="dapo")  # the one big batch
    _close(
        sum(torch.as_tensor(x, dtype=torch.float64) for x in got),
        want.item(),
        1e-6,
        "The micro-batch losses must add up to the big batch's: every token of the step weighs the same.",
    )
    _close(
        _losses(got),
        _losses([per_token_loss[p].sum() / mask.sum() for p in parts]),
        1e-6,
        "Each micro-batch's loss holds only its own tokens' losses, each divided by the token count of the whole step.",
    )
    return True


# ----------------------------------------------------------------------------------------------------------------------
# 04 · replay buffers
# ----------------------------------------------------------------------------------------------------------------------


def _04_1(answer):
    _near_hash("04.1", answer, "ff26df3cca2b99b5", 1e-3, "P(i) = |A_i|^alpha / sum_j |A_j|^alpha.")


def _04_2(answer):
    _near_hash(
        "04.2",
        answer,
        "3d9ad767650559fa",
        1e-3,
        "ESS = 1 / sum_i P(i)^2, with the P(i) of the previous exercise (alpha = 1).",
    )


def _04_3(fn):
    adv = torch.tensor([2.0, -1.0, 1.0, 0.5, 0.0])
    age = torch.tensor([0.0, 1.0, 2.0, 0.0, 0.0])
    got = _tensor_fn(fn, adv, age, 1.0, 2.0)
    if got is None:
        return None
    w = torch.tensor([2.0, math.exp(-0.5), math.exp(-1.0), 0.5, 0.0], dtype=torch.float64)
    _close(got, w / w.sum(), 1e-6, "priority = |A|^alpha * exp(-age / tau), then divide by the sum.")
    w0 = torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), 1.0, 0.0], dtype=torch.float64)  # alpha = 0: |A|^0 = 1
    _close(
        _tensor_fn(fn, adv, age, 0.0, 2.0),
        w0 / w0.sum(),
        1e-6,
        "With alpha = 0, |0| ** 0 is 1 in Python and torch, but a sample with advantage 0 must get probability 0.",
    )
    buffer = grpo_ssr.SSRReplayBuffer(capacity=4, alpha=2.0)
    buffer.add([{"advantages": a} for a in adv[:4]])
    _close(
        _tensor_fn(fn, adv[:4], torch.zeros(4), 2.0, math.inf),
        buffer.probabilities(),
        1e-6,
        "With tau = inf (no decay) it should give SSRReplayBuffer's probabilities for the same alpha.",
    )
    return True


# ----------------------------------------------------------------------------------------------------------------------
# 06 · a real model learns sums
# ----------------------------------------------------------------------------------------------------------------------


def _06_1(answer):
    _same_hash(
        [int(v) for v in answer],
        "c009b8af98ea96ee",
        "Give (first-number total, anywhere total). The first rule reads only the first number of each "
        "completion; the lenient one accepts 12 wherever it appears.",
    )


# (completion, the strict reader's answer); the second list holds what float() reads but a number written out is not
STRICT_CASES = [
    ("12", 12.0),
    (" 12.\n", 12.0),
    ("-3", -3.0),
    ("2.5", 2.5),
    ("0", 0.0),
    ("7 + 5 = 12", None),
    ("The answer is 12.", None),
    ("12 apples", None),
    ("12, 13", None),
    ("1 2", None),
    ("twelve", None),
    ("", None),
    (".", None),
]
NOT_WRITTEN_OUT = ["1e1", "nan", "inf", "+5", "1_000", ".5", "12..", "\uff11\uff12", "\u0661\u0662"]


def _06_2(fn):
    if fn("12") is None:  # the unanswered stub returns None for everything
        return None
    for text, want in STRICT_CASES + [(text, None) for text in NOT_WRITTEN_OUT]:
        got = fn(text)
        ok = (got is None and want is None) or (got is not None and want is not None and float(got) == want)
        hint = (
            "float() reads more than a number written out: exponents, nan and inf, a plus sign, underscores and "
            "digits of other scripts (full-width \uff11\uff12, in Python's re \\d too). Accept only the ASCII digits "
            "0-9, with an optional minus sign and decimal part"
            if text in NOT_WRITTEN_OUT
            else "The whole completion must be one number: only whitespace around it and one final period are allowed"
        )
        _require(ok, f"strict_answer({text!r}) gave {got!r}, expected {want!r}. {hint}.")
    return True


def _06_3(fn):
    completions = [
        "12",
        "12",
        "12",
        "12",  # all right: zero spread
        "8",
        "10",
        "nine",
        "7 + 2 = 9",  # all wrong for the first-number rule: zero spread
        "5",
        "6",
        "5",
        "4",
    ]  # mixed
    answers = [12] * 4 + [9] * 4 + [5] * 4
    got = fn(completions, answers, 4)
    if got is None:
        return None
    _close(
        got,
        2 / 3,
        1e-9,
        "Score every completion with reward_accuracy, cut the rewards into groups of G "
        "consecutive ones, and count the groups whose rewards are all equal: all right counts too.",
    )
    anywhere = lambda completions, answer, **kw: [
        float(float(a) in map(float, grpo_ssr.FIRST_NUMBER.findall(c))) for c, a in zip(completions, answer)
    ]
    _close(
        fn(completions, answers, 4, anywhere),
        1 / 3,
        1e-9,
        "Use the reward_func passed in: with the lenient rule, '7 + 2 = 9' is right, and its group is mixed.",
    )
    gen = torch.Generator().manual_seed(0)
    right = torch.rand(48, generator=gen) < 0.7
    answers = [int(a) for a in torch.randint(0, 100, (48,), generator=gen)]
    completions = [str(a if ok else a + 1) for a, ok in zip(answers, right)]
    rewards = torch.tensor(grpo_ssr.reward_accuracy(completions, answer=answers))
    _close(
        fn(completions, answers, 3),
        grpo_ssr.zero_spread_groups(rewards, 3).float().mean(),
        1e-9,
        "It should agree with the trainer's frac_reward_zero_std for any group size G.",
    )
    return True


# ----------------------------------------------------------------------------------------------------------------------
# study 01 · training with replay: the replay study
# ----------------------------------------------------------------------------------------------------------------------


def _s01_1(fn):
    base = [0.020, 0.080, 0.045, 0.120, 0.060, 0.030, 0.100, 0.070]  # seeds differ a lot; the arm's gain does not
    gain = [0.012, 0.004, 0.015, -0.003, 0.010, 0.008, 0.020, 0.006]
    arm = [b + g for b, g in zip(base, gain)]
    got = fn(np.array(arm), np.array(base), 10_000, 0)
    if got is None:
        return None
    _require(len(got) == 3, f"expected (mean, low, high), got {_show(got)}")
    _close(got[0], 0.009, 1e-9, "The first number is the mean of the per-seed differences arm - baseline.")
    # the reference interval: 400,000 resamples; any 10,000 land within a small fraction of its width of it
    _close(
        got[1:],
        (0.004375, 0.0135),
        0.0014,
        "Resample the seeds (the same indices for both arms), average each resample's differences, and take the "
        "2.5th and 97.5th percentiles of those means.",
    )
    flat = fn(np.array(arm), np.array(arm) - 0.01, 2_000, 1)
    _close(flat, (0.01, 0.01, 0.01), 1e-9, "If every seed gains exactly 0.01, the interval is the single point 0.01.")
    return True


def _s01_2(answer):
    _near_hash(
        "S01.2",
        answer,
        "9c1ae29f213b5c25",
        5e-4,
        "replay_abs_log_ratio, not sample_age; over steps 101-150 only: per run the mean over those steps "
        "(skipping steps that logged none), then the mean over the 8 seeds.",
    )


# ----------------------------------------------------------------------------------------------------------------------
# 08 · when GRPO learns nothing
# ----------------------------------------------------------------------------------------------------------------------


def _08_1(answer):
    lengths = torch.tensor([2, 4, 4, 6])
    mask = (torch.arange(6)[None] < lengths[:, None]).long()  # (4, 6)
    advantages = grpo_ssr.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    logps = torch.zeros(4, 6)
    want, _ = grpo_ssr.grpo_loss(logps, logps, advantages, mask, loss_type="dapo")  # the first iteration: ratio 1
    _close(
        answer,
        want.item(),
        1e-3,
        "With the ratio 1 each token's loss is -A of its completion; dapo divides the sum over all tokens by their "
        "number (16). The advantages sum to 0, but the lengths weigh them.",
    )


def _08_2(fn):
    logits = torch.log(torch.tensor([[4.0, 2.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    got = _tensor_fn(fn, logits, 2)
    if got is None:
        return None
    _require(got.shape == (2,), f"expected one ratio per row, shape (2,), got {tuple(got.shape)}")
    _close(
        got,
        [0.75, 0.5],
        1e-6,
        "pi is the full softmax, pi_sampler the softmax over the top k only: their ratio "
        "for a kept token is the share of the probability that the top k hold.",
    )
    _close(_tensor_fn(fn, logits, 4), [1.0, 1.0], 1e-6, "With k = V the sampler is the full softmax: the ratio is 1.")
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    _close(
        _tensor_fn(fn, x, 7),
        torch.softmax(x, -1).topk(7, -1).values.sum(-1),
        1e-6,
        "It should work for any logits and any k.",
    )
    return True


def _08_3(answer):
    _near_hash(
        "08.3",
        answer,
        "04ad83c1cfc3e1ef",
        5e-4,
        "The mean is -19.975; 'group' divides by the group's unbiased std (ddof 1) + 1e-4, 'none' by nothing.",
    )


# ----------------------------------------------------------------------------------------------------------------------
# Self-checks: two or three short questions at the end of each course notebook, `check("01.Q", {1: ..., 2: ...})`
# ----------------------------------------------------------------------------------------------------------------------

# One (digest, hint) per question. A digest hashes (id, question number, answer): the answers are not written here.
QUIZZES: dict[str, list[tuple[str, str]]] = {
    "01.Q": [
        ("941c0eedd16e0b99", "Rows i*G to i*G + G - 1 are prompt i's group (generate_completions' docstring)."),
        ("a5aa664c105ab91e", "Think of where the decode loop writes each new token, for every row at once."),
        ("4c8039e1dc211190", "reward_len's best reward is 0, at exactly 20 characters; it falls by 1 a character."),
    ],
    "02.Q": [
        ("f1ce50c27c5f240e", "The mean is subtracted first; group_advantages then forces zero-spread groups to 0."),
        ("05dd883b06342be7", "Subtract the group's mean; scale_rewards 'none' divides by nothing."),
        ("eca35c2392409d7f", "GRPO has no critic: what does each reward get compared with?"),
    ],
    "03.Q": [
        ("14060d6b8b633bd2", "At the first iteration the old log-probs come from the very weights being trained."),
        ("14d1ad7735a7b605", "Section 4: which normalisation gives every token of the whole step the same weight?"),
        ("d4738845a017a0d7", "GRPOStep.__init__ copies the model only when the KL term has a weight above 0."),
    ],
    "04.Q": [
        ("2e83d4e347869b1a", "A zero advantage is never stored; then P(i) = |A_i|^alpha / sum_j |A_j|^alpha."),
        ("c8f234c8555b217a", "The uniform buffer holds one generation batch and is drawn without replacement."),
        ("b40a69588a56873a", "fill trains every sample with A != 0 and draws only into the other slots."),
    ],
    "05.Q": [
        ("b3a5b29154b72807", "generation_batch_size = per_device_train_batch_size x gradient_accumulation_steps."),
        ("daaed21495a36d03", "The micro-batches' gradients add up; how many times does update() run per step?"),
        ("59b9196ac0abb08f", "Read GRPOStep's docstring: where every sample first trains in the step that made it."),
    ],
    "06.Q": [
        ("ed3644c0e775cb52", "It is the share of the step's groups with zero spread; how many groups are there?"),
        ("79ddc05106e55acd", "A right answer scores 1, a wrong one 0; subtract the group's mean, divide by nothing."),
        ("5130ee9e49917a5d", "Read the verdict in the README's Results, or notebooks/study/README.md."),
    ],
    "07.Q": [
        ("51f2ea3400b53ff0", "Section 2: what is the most that exists at a time in HeadLogProbs' backward?"),
        ("96df90796f8e6d9b", "Section 3: the ratio is exactly 1 only if the log-probs describe the sampler."),
        ("8fc79fcd718d7dd5", "Section 1: one function decides the device and the autocast for every forward."),
    ],
    "08.Q": [
        ("893a3ddefb6b03f9", "Section 1: the loss is near 0 by construction; its gradient is not."),
        ("ab9bbfff8d115b83", "Section 2: an instruct model says EOS only through its chat template."),
        ("eef6f4236dbf6e4f", "Section 4: on-policy, with the sampler the log-probs describe, no token is clipped."),
    ],
}


def _quiz_value(value):
    """An answer as compared: a letter in lower case, a number to 3 decimals, a pair as a list."""
    if isinstance(value, str):
        return value.strip().lower()
    if isinstance(value, (list, tuple)):
        return [_quiz_value(v) for v in value]
    return round(float(value), 3)


def _quiz(exercise: str, answers) -> None:
    """`answers`: a dict {1: ..., 2: ...} or the answers in order. Every question must be answered; then one verdict
    for them all, and on a wrong one every question's hint, the same line whichever answers are wrong."""
    if not isinstance(answers, dict):
        answers = dict(enumerate(answers, 1))
    questions = QUIZZES[exercise]
    values = [answers.get(number, answers.get(str(number))) for number in range(1, len(questions) + 1)]
    missing = [str(number) for number, value in enumerate(values, 1) if value is None]
    _require(
        not missing,
        f"question{'s' if len(missing) > 1 else ''} {', '.join(missing)} {'have' if len(missing) > 1 else 'has'} no "
        f"answer yet: answer all {len(questions)}, and the check gives one verdict for them all.",
    )
    right = 0
    for number, (value, (digest, _)) in enumerate(zip(values, questions), 1):
        try:
            normal = _quiz_value(value)
        except (TypeError, ValueError):
            normal = None
        right += _digest([exercise, number, normal]) == digest
    hints = " ".join(f"({number}) {hint}" for number, (_, hint) in enumerate(questions, 1))
    _require(
        right == len(questions),
        f"not all {len(questions)} answers are right yet (the check does not say which, so trying the options one at "
        f"a time tells you nothing). A hint for each question: {hints}",
    )


# 09 · hands on: change the algorithm and train
# ----------------------------------------------------------------------------------------------------------------------


def _one_thread(check: Callable) -> Callable:
    """Run a check that trains on one thread (the tiny model gains nothing from more), then restore the count."""

    def run(answer):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return check(answer)
        finally:
            torch.set_num_threads(threads)

    return run


def _tiny_step(reward, steps: int, seed: int = 0, **overrides) -> grpo_ssr.GRPOStep:
    """A GRPOStep on the tiny model and the built-in prompts, at notebook 09's sizes, seeded."""
    torch.manual_seed(seed)
    tok = grpo_ssr.build_tiny_tokenizer()
    model = grpo_ssr.build_tiny_model(len(tok))
    settings = dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=24, learning_rate=3e-3)
    cfg = grpo_ssr.AlgorithmConfig(**{**settings, **overrides, "max_steps": steps, "seed": seed})
    return grpo_ssr.GRPOStep(model, tok, [reward], cfg, grpo_ssr.builtin_prompts())


def _leave_one_out(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """The check's own leave-one-out advantages, in float64: G / (G - 1) * (r - group mean), 0 without spread."""
    grouped = rewards.double().view(-1, num_generations)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)) * num_generations / (num_generations - 1)
    return torch.where(grpo_ssr.zero_spread_groups(rewards, num_generations)[:, None], 0.0, adv).view(-1)


@_one_thread
def _09_1(fn):
    if _02_2(fn) is None:  # the hand-computed groups of exercise 02.2 first
        return None
    flat = _tensor_fn(fn, torch.tensor([0.3] * 8 + [0.0] * 7 + [1.0]), 8)
    _require(
        bool((flat[:8] == 0).all()),
        f"a group of eight rewards 0.3 got {_show(flat[:8])}: a group without spread must get exactly 0 "
        "(the division leaves a rounding error; SSR stores every sample whose advantage is not exactly 0)",
    )
    # wired into a real step: generate_batch calls the module's group_advantages, so replace it there
    step = _tiny_step(grpo_ssr.reward_len, steps=2)
    before = [p.detach().clone() for p in step.model.parameters()]
    G = step.cfg.num_generations
    with mock.patch.object(
        grpo_ssr, "group_advantages", lambda rewards, num_generations, scale_rewards: fn(rewards, num_generations)
    ):
        for _ in range(2):
            step.train_step()
            stored = torch.stack([torch.as_tensor(s["advantages"]).double().cpu() for s in step.batch])
            _close(
                stored,
                _leave_one_out(step.scored["rewards"], G),
                1e-4,
                f"the advantages the step stored are not leave-one-out of its own rewards (G = {G} here): "
                "does your function work for any group size and any number of groups?",
            )
    moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, step.model.parameters()))
    _require(moved, "the advantages were right but the weights did not move: return a float tensor of shape (B,)")
    return True


def _held(buffer) -> list[dict]:
    return [s for s in buffer.slots if s is not None]


@_one_thread
def _09_2(cls):
    cfg = grpo_ssr.AlgorithmConfig(replay_buffer_class="SSRReplayBuffer", ssr_age_decay=0.0)
    made = lambda capacity, seed: cls(capacity, cfg.ssr_alpha, seed=seed, max_age=cfg.ssr_max_age, age_decay=0.0)
    probe = made(8, 0)
    if probe is None:
        return None
    _require(isinstance(probe, grpo_ssr.SSRReplayBuffer), "subclass grpo_ssr.SSRReplayBuffer and override _weights()")
    advantages = [3.0, -1.0, 0.0, 0.5, 1.0, -0.0]
    probe.add([{"advantages": torch.tensor(a), "step": 0} for a in advantages])
    weights = probe._weights()
    held = torch.tensor([float(s["advantages"]) for s in _held(probe)])
    declared = probe.expected_probabilities(held)
    if weights is None or declared is None:
        return None
    _require(
        len(probe) == 4 and bool((held != 0).all()),
        f"the buffer holds {len(probe)} samples of advantages {_show(held)}: it must turn away the two zeros",
    )
    declared = torch.as_tensor(declared, dtype=torch.float64)
    _require(
        declared.shape == (4,) and bool((declared >= 0).all()) and abs(float(declared.sum()) - 1) < 1e-6,
        f"expected_probabilities gave {_show(declared)}: one probability per held sample, summing to 1",
    )
    _require(
        not torch.allclose(declared, held.abs().double() / held.abs().sum(), atol=1e-6),
        "that is SSR's own rule, P(i) ~ |A_i|: declare another one (rank-based, clipped, uniform, ...)",
    )
    weights = torch.as_tensor(weights, dtype=torch.float64)
    _require(
        weights.shape == (8,) and bool((weights[[i for i, s in enumerate(probe.slots) if s is None]] == 0).all()),
        f"_weights() gave {_show(weights)}: one weight per slot (capacity 8 here), 0 for an empty slot",
    )
    # trained through the real loop: the buffer fills as make_buffer's would, then its own sample() is counted
    step = _tiny_step(grpo_ssr.reward_len, steps=3, replay_buffer_class="SSRReplayBuffer", ssr_mode="replace")
    step.buffer = made(step.buffer.capacity, step.cfg.seed)
    for _ in range(3):
        step.train_step()
    held = _held(step.buffer)
    advantages = torch.tensor([float(s["advantages"]) for s in held])
    _require(bool((advantages != 0).all()), "a zero-advantage sample was stored: SSR must turn them away")
    want = torch.as_tensor(step.buffer.expected_probabilities(advantages), dtype=torch.float64)
    n = 20_000
    step.buffer.generator.manual_seed(1234)
    drawn = step.buffer.sample(n)
    _require(all(s is not None for s in drawn), "sample() drew an empty slot: give empty slots weight 0")
    _require(all(float(s["advantages"]) != 0 for s in drawn), "sample() drew a zero-advantage sample")
    where = {id(s): i for i, s in enumerate(held)}
    counts = torch.bincount(torch.tensor([where[id(s)] for s in drawn]), minlength=len(held)).double()
    sd = (n * want * (1 - want)).sqrt()
    z = torch.where(want > 0, (counts - n * want).abs() / sd.clamp(min=1e-12), counts * math.inf)
    worst = int(z.argmax())
    _require(
        float(z.max()) < 5,
        f"of {n} draws over {len(held)} samples, sample {worst} came {int(counts[worst])} times, "
        f"but expected_probabilities gives it {float(want[worst]):.4g} ({n * float(want[worst]):.0f} expected, "
        f"sd {float(sd[worst]):.1f}): _weights() must give each slot the weight your rule gives its sample",
    )
    return True


def _built_in_reward(fn) -> str | None:
    """The name of the built-in reward of grpo_ssr that `fn` is, or behaves as on a probe of completions of 0 to 40
    characters (the same rewards, or a shift or positive rescaling of them: GRPO's group advantages are then the
    same); None if it is none of them."""
    for name, built_in in grpo_ssr.REWARD_FUNCS.items():
        if fn is built_in:
            return name
    probe = ["ab" * n for n in range(21)] + ["hello there", "\x00\x01 XYZ", "a" * 19, "a" * 21]
    got = np.asarray(fn(completions=probe, prompts=["a"] * len(probe)), dtype=np.float64)
    standard = lambda v: (v - v.mean()) / (v.std() if v.std() > 0 else 1.0)
    for name in ("reward_len", "reward_len_binary"):  # reward_accuracy needs an answer column the prompts lack
        want = np.asarray(grpo_ssr.REWARD_FUNCS[name](probe), dtype=np.float64)
        if got.shape == want.shape and np.isfinite(got).all() and np.allclose(standard(got), standard(want)):
            return name
    return None


@_one_thread
def _09_3(fn):
    probe = fn(completions=["hello there", "", "\x00\x01 XYZ"], prompts=["a", "b", "c"])
    if probe is None:
        return None
    _require(len(probe) == 3, f"expected one reward per completion (3), got {_show(probe)}")
    built_in = _built_in_reward(fn)
    _require(
        built_in is None,
        f"that is grpo_ssr's {built_in} (or the same rewards up to a shift or scale, which give the same advantages): "
        "write a reward of your own, for example one of the ideas above the exercise",
    )
    step = _tiny_step(fn, steps=30)
    rows = [step.train_step() for _ in range(30)]
    _require(
        any(r["reward_std"] > 0 for r in rows),
        "in 30 steps every completion of a batch got the same reward: without spread in a group every advantage is "
        "0 and GRPO learns nothing. Choose a reward that varies between the completions of the random model",
    )
    rewards = np.array([r["reward"] for r in rows])
    first, last = rewards[:10], rewards[-10:]
    gain = last.mean() - first.mean()
    noise = math.sqrt(first.var(ddof=1) / 10 + last.var(ddof=1) / 10)
    _require(
        gain > 0 and gain > 3 * noise,
        f"the mean reward of steps 1-10 was {first.mean():.4g}, of steps 21-30 {last.mean():.4g} (noise {noise:.2g}): "
        "it did not go up by 3 times the noise. Make it something the random model sometimes does and could do "
        "more of, by degrees (a share of characters, a distance to a length) rather than all or nothing",
    )
    return True


CHECKS: dict[str, Callable] = {
    "01.1": _01_1,
    "01.2": _01_2,
    "01.3": _01_3,
    "02.1": _02_1,
    "02.2": _02_2,
    "03.1": _03_1,
    "03.2": _03_2,
    "03.3": _03_3,
    "03.4": _03_4,
    "04.1": _04_1,
    "04.2": _04_2,
    "04.3": _04_3,
    "06.1": _06_1,
    "06.2": _06_2,
    "06.3": _06_3,
    "08.1": _08_1,
    "08.2": _08_2,
    "08.3": _08_3,
    "09.1": _09_1,
    "09.2": _09_2,
    "09.3": _09_3,
    "S01.1": _s01_1,
    "S01.2": _s01_2,
    **{exercise: functools.partial(_quiz, exercise) for exercise in QUIZZES},
}


def check(exercise: str, answer) -> bool:
    """Print whether `answer` solves `exercise`: True when it does, False when not answered yet; a wrong answer raises
    NotYet, one line with a hint."""
    try:
        unanswered = answer is None or (CHECKS[exercise](answer) is None and callable(answer))  # a function: None
    except NotYet as e:
        raise NotYet(f"exercise {exercise}: not yet: {e}") from None
    if unanswered:
        print(f"exercise {exercise}: not answered yet")
        return False
    print(f"exercise {exercise}: correct")
    return True
