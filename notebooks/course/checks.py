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
        ("59b9196ac0abb08f", "GRPOStep.old_logps says it: where every sample first trains in the step that made it."),
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
            stored = torch.stack([torch.as_tensor(s["advantages"]).double().cpu() for s in step.generation_batch])
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


# ----------------------------------------------------------------------------------------------------------------------
# 10 · build GRPO yourself: each piece against grpo_ssr's on fixed inputs, edge cases included
# ----------------------------------------------------------------------------------------------------------------------


def _10_1(fn):
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0])  # by hand: std 0.5 and 0.8165 (unbiased)
    got = _tensor_fn(fn, r, 4)
    if got is None:
        return None
    _require(got.shape == (8,), f"expected one advantage per completion, shape (8,), got {tuple(got.shape)}")
    want = grpo_ssr.group_advantages(r, 4)
    grouped = r.double().view(-1, 4)
    centred = grouped - grouped.mean(1, keepdim=True)
    if torch.allclose(got, (centred / (grouped.std(1, unbiased=False, keepdim=True) + 1e-4)).view(-1), atol=1e-5):
        hint = "that is the population std (divide by G): use the unbiased one (divide by G - 1), as TRL"
    elif torch.allclose(got, (centred / grouped.std(1, keepdim=True)).view(-1), atol=1e-5):
        hint = "divide by the group's std + 1e-4 (TRL's guard against a tiny std), not by the std alone"
    else:
        hint = "A_i = (r_i - mean of its group) / (unbiased std of its group + 1e-4); groups are blocks of G"
    _close(got, want, 1e-5, hint)
    flat = _tensor_fn(fn, torch.tensor([0.3] * 8 + [0.0] * 7 + [1.0]), 8)
    _require(
        bool((flat[:8] == 0).all()),
        f"a group of eight rewards 0.3 got {_show(flat[:8])}: a group without spread must get exactly 0 "
        "(the mean leaves a rounding error, and / (0 + 1e-4) blows it up; SSR stores every advantage that is not 0)",
    )
    nan = math.nan
    r = torch.tensor([1.0, nan, 0.0, 0.0, nan, nan, nan, 2.0, nan, nan, nan, nan, 5.0, 5.0, nan, 5.0])
    got = _tensor_fn(fn, r, 4)
    _require(
        not bool(got.isnan().any()),
        f"with NaN rewards (unscorable completions) you gave {_show(got)}: a NaN reward gets advantage 0, and is left "
        "out of its group's mean and std (nanmean, and a std of the scored rewards only)",
    )
    _close(
        got,
        grpo_ssr.group_advantages(r, 4),
        1e-5,
        "leave a NaN reward out of its group's mean and std (as if the group had only its scored completions), give "
        "it 0, and give a group with fewer than two distinct scored rewards exactly 0",
    )
    return True


def _surrogate_case():
    """Four sequences of four tokens; the last ones padded (mask 0) with log-probs far from the old ones. Rows: A > 0
    with ratio above 1 + eps (clipped), A < 0 with ratio below 1 - eps (clipped), and the two sides not clipped."""
    logps = torch.tensor(
        [
            [-1.0, -1.2, -0.8, 5.0],
            [-2.0, -2.5, -2.2, -9.0],
            [-1.5, -1.0, 3.0, 4.0],
            [-0.7, -0.9, -1.1, -1.3],
        ],
        dtype=torch.float64,
    )
    log_ratio = torch.tensor(
        [[0.5, 0.4, 0.3, 2.0], [-0.5, -0.4, -0.3, 1.5], [0.5, -0.5, 1.0, 2.0], [-0.5, 0.5, 0.05, 0.0]],
        dtype=torch.float64,
    )
    old = logps - log_ratio
    adv = torch.tensor([1.0, -1.0, -2.0, 1.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    return logps, old, adv, mask


def _loss_of(fn, logps, old, adv, mask, loss_type, tokens, sequences):
    logps = logps.clone().requires_grad_(True)
    out = fn(logps, old, adv, mask, loss_type, tokens, sequences, 0.2)
    if out is None:
        return None, None
    loss = torch.as_tensor(out)
    grad = torch.autograd.grad(loss, logps, allow_unused=True)[0] if loss.requires_grad else None
    return loss.detach().double(), (torch.zeros_like(logps) if grad is None else grad)


def _10_2(fn):
    logps, old, adv, mask = _surrogate_case()
    unpadded = torch.ones_like(mask)
    got, grad = _loss_of(fn, logps[:, :3], old[:, :3], adv, unpadded[:, :3], "dapo", 12, 4)
    if got is None:
        return None
    want, _ = grpo_ssr.grpo_loss(logps[:, :3], old[:, :3], adv, unpadded[:, :3], loss_type="dapo")
    ratio = (logps - old)[:, :3].exp()
    swapped = (-torch.max(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])).mean()
    _close(
        got,
        want.item(),
        1e-6,
        "the per-token loss is -min(rho * A, clip(rho, 1 - eps, 1 + eps) * A), the pessimistic side: "
        + (
            "you took the max, which clips the wrong side"
            if abs(got.item() - swapped.item()) < 1e-6
            else "check the ratio rho = exp(logp - old) and the clip"
        ),
    )
    x = logps[:, :3].clone().requires_grad_(True)
    want_grad = torch.autograd.grad(grpo_ssr.grpo_loss(x, old[:, :3], adv, unpadded[:, :3])[0], x)[0]
    _close(
        grad,
        want_grad,
        1e-6,
        "the value is right but not its gradient: a clipped token (ratio above 1 + eps with A > 0, below 1 - eps with "
        "A < 0) must pass no gradient",
    )
    tokens, sequences = int(mask.sum()), 4
    for loss_type in ("dapo", "grpo"):
        got, _ = _loss_of(fn, logps, old, adv, mask, loss_type, tokens, sequences)
        want, _ = grpo_ssr.grpo_loss(logps, old, adv, mask, loss_type=loss_type, num_items_in_batch=tokens)
        token_mean, _ = grpo_ssr.grpo_loss(logps, old, adv, mask, loss_type="dapo")
        hint = (
            "grpo is a mean of per-sequence means: average each sequence over its own tokens first, then over the "
            "sequences (a mean over all tokens is dapo)"
            if loss_type == "grpo" and abs(got.item() - token_mean.item()) < 1e-6
            else f"with padding ({loss_type}): the padded tokens count: multiply by the completion mask before summing "
            "(and mask the log-ratio before exp: a padded slot's log-probs are anything)"
        )
        _close(got, want.item(), 1e-6, hint)
    # gradient accumulation: two micro-batches of unequal token counts (9 and 4 tokens, 3 sequences and 1)
    parts = [slice(0, 3), slice(3, 4)]
    for loss_type, hint in (
        (
            "dapo",
            "dapo divides each micro-batch's summed token losses by the token count of the whole step (step_tokens), "
            "not by its own: the micro-batches' losses must sum to the whole batch's",
        ),
        (
            "grpo",
            "grpo averages each sequence over its own tokens, sums those means and divides by the sequences of the "
            "whole step (step_sequences): not a mean over tokens, and not over this micro-batch's sequences",
        ),
    ):
        whole, _ = grpo_ssr.grpo_loss(logps, old, adv, mask, loss_type=loss_type, num_items_in_batch=tokens)
        got = [_loss_of(fn, logps[p], old[p], adv[p], mask[p], loss_type, tokens, sequences)[0] for p in parts]
        want = [
            grpo_ssr.grpo_loss(
                logps[p], old[p], adv[p], mask[p], loss_type=loss_type, num_items_in_batch=tokens, num_sequences=4
            )[0].item()
            for p in parts
        ]
        _close(
            torch.stack(got), want, 1e-6, f"{hint} (yours sum to {float(sum(got)):.6g}, the batch's {whole.item():.6g})"
        )
    return True


def _10_3(fn):
    adv = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5, 1.0])  # slot 3 is empty: it still holds an evicted sample's 3.0
    ages = torch.tensor([0.0, 1.0, 2.0, 5.0, 0.0, 3.0])
    filled = torch.tensor([True, True, True, False, True, True])
    got = _tensor_fn(fn, adv, ages, filled, 1.0, 2.0)
    if got is None:
        return None
    _require(got.shape == (6,), f"expected one probability per slot, shape (6,), got {tuple(got.shape)}")
    _require(
        float(got[3]) == 0,
        f"got {_show(got)}: an empty slot must get probability 0, whatever advantage it still holds",
    )
    w = adv.abs().double() * torch.exp(-ages.double() / 2) * filled
    if torch.allclose(got, (w * torch.exp(ages.double())) / (w * torch.exp(ages.double())).sum(), atol=1e-6):
        hint = "the decay must favour the young: exp(-age / age_decay), not exp(+age / age_decay)"
    else:
        hint = "P(i) = |A_i|^alpha * exp(-age_i / age_decay) / the sum over the filled slots"
    _close(got, w / w.sum(), 1e-6, hint)
    w2 = adv.abs().double() ** 2 * torch.exp(-ages.double() / 2) * filled
    _close(_tensor_fn(fn, adv, ages, filled, 2.0, 2.0), w2 / w2.sum(), 1e-6, "with alpha = 2: |A|^alpha, use alpha")
    # the real buffer: samples added over several steps, the oldest evicted by max_age, then compared with its own
    buffer = grpo_ssr.SSRReplayBuffer(capacity=8, alpha=0.5, max_age=3, age_decay=1.5)
    for step, advantages in enumerate([[1.0, 0.0, -2.0], [0.5, 4.0], [0.0, -1.0, 2.5], [3.0], [-0.25, 1.5]]):
        buffer.advance_to(step)
        buffer.add([{"advantages": torch.tensor(a), "step": step} for a in advantages])
    buffer.advance_to(5)
    slots_adv = torch.tensor([0.0 if s is None else float(s["advantages"]) for s in buffer.slots])
    filled = torch.tensor([s is not None for s in buffer.slots])
    held = (buffer.next_slot - buffer.size + torch.arange(buffer.size)) % buffer.capacity
    want = torch.zeros(8, dtype=torch.float64)
    want[held] = buffer.probabilities()
    got = _tensor_fn(fn, slots_adv, buffer.clock - buffer.made_at, filled, buffer.alpha, buffer.age_decay)
    _close(got, want, 1e-6, "on a real SSRReplayBuffer (alpha 0.5, age_decay 1.5, some slots evicted) yours differ")
    zero = _tensor_fn(fn, torch.tensor([1.0, 0.0, 2.0]), torch.zeros(3), torch.ones(3, dtype=torch.bool), 0.0, 0.0)
    _close(zero, [0.5, 0.0, 0.5], 1e-6, "with alpha = 0 and a zero advantage: |0| ** 0 is 1, but 0 must stay 0")
    return True


def _step_batch(seed: int = 0, prompts: int = 4, G: int = 4, C: int = 12, temperature: float = 0.7):
    """The tiny model and one generation batch of it (left-padded prompts of unequal lengths), scored by reward_len."""
    torch.manual_seed(seed)
    model, tok = grpo_ssr.load_model("tiny")
    rows = grpo_ssr.builtin_prompts()[:prompts]
    batch = grpo_ssr.generate_completions(model, tok, grpo_ssr.prompt_texts(rows, tok), G, 512, C, temperature)
    rewards, _, _ = grpo_ssr.score_generations(batch, rows, G, tok, [grpo_ssr.reward_len], [1.0])
    batch["advantages"] = grpo_ssr.group_advantages(rewards, G)
    return model, batch


def _micro_batches(batch: dict, n: int) -> list[dict]:
    size = len(batch["advantages"]) // n
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(n)]


def _reference_step(model, optimizer, micro_batches, cfg, temperature=None, clip=True, old_after=False, zero=True):
    """GRPOStep's core, with grpo_ssr's own pieces; the keywords make the mistakes the hints name."""
    T = cfg.temperature if temperature is None else temperature

    def logps(mb):
        ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
        mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
        return grpo_ssr.per_token_logps(model, ids, mask, mb["completion_ids"].size(1), T)

    with torch.no_grad():
        old = [logps(mb) for mb in micro_batches]
    tokens = float(sum(mb["completion_mask"].sum() for mb in micro_batches))
    sequences = sum(len(mb["advantages"]) for mb in micro_batches)
    for _ in range(cfg.num_iterations):
        if old_after:
            with torch.no_grad():
                old = [logps(mb) for mb in micro_batches]
        for mb, old_logps in zip(micro_batches, old):
            loss, _ = grpo_ssr.grpo_loss(
                logps(mb),
                old_logps,
                mb["advantages"],
                mb["completion_mask"],
                epsilon_low=cfg.epsilon,
                loss_type=cfg.loss_type,
                num_items_in_batch=tokens,
                num_sequences=sequences,
            )
            loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        if zero:
            optimizer.zero_grad()


def _moves(step, model, batch, micro_batches: int, cfg, lr: float, **mistakes) -> torch.Tensor:
    """How far one call of `step` moves the weights, from a copy of `model`, with SGD (every factor of the gradient
    shows in the update; AdamW would hide its scale). The reference's when `step` is None."""
    import copy

    model = copy.deepcopy(model)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    mbs = _micro_batches(batch, micro_batches)
    if step is None:
        _reference_step(model, optimizer, mbs, cfg, **mistakes)
    elif step(model, optimizer, mbs, cfg) is None:
        return None
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def _same_move(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same update to within a thousandth of its largest move (the solution's is within about 1e-6)."""
    return float((got - want).abs().max()) <= 1e-3 * float(want.abs().max()) + 1e-9


@_one_thread
def _10_4(fn):
    model, batch = _step_batch()
    cases = [  # (what it tries, micro-batches, settings)
        ("one micro-batch, one iteration, no clipping", 1, dict(num_iterations=1, max_grad_norm=1e6)),
        ("the gradient clipped to max_grad_norm 0.01", 1, dict(num_iterations=1, max_grad_norm=0.01)),
        ("two micro-batches (dapo)", 2, dict(num_iterations=1, max_grad_norm=0.01)),
        ("two micro-batches, num_iterations 2 (grpo)", 2, dict(num_iterations=2, max_grad_norm=0.01, loss_type="grpo")),
    ]
    for what, n, settings in cases:
        cfg = grpo_ssr.GRPOConfig(**{"temperature": 0.7, "loss_type": "dapo", **settings})
        lr = 1.0 if settings["max_grad_norm"] > 1 else 10.0
        got = _moves(fn, model, batch, n, cfg, lr)
        if got is None:
            return None
        want = _moves(None, model, batch, n, cfg, lr)
        if _same_move(got, want):
            continue
        mistakes = [
            (
                dict(temperature=1.0),
                "divide the logits by the sampling temperature (cfg.temperature) before the "
                "log-softmax: the log-probs must describe the distribution the completions were drawn from",
            ),
            (
                dict(clip=False),
                "clip the gradient's global norm to cfg.max_grad_norm (torch.nn.utils.clip_grad_norm_) "
                "after the micro-batches' backward passes, before optimizer.step()",
            ),
            (
                dict(old_after=True),
                "the old log-probs must be the sampling policy's: compute them once, before the "
                "first update, and keep them for every iteration (taken after an update, the ratio is 1 again)",
            ),
            (
                dict(zero=False),
                "zero the gradients after each optimizer step (optimizer.zero_grad()): else the next "
                "step adds its gradient onto the last one's",
            ),
        ]
        named = [hint for kwargs, hint in mistakes if _same_move(got, _moves(None, model, batch, n, cfg, lr, **kwargs))]
        if float(got.abs().max()) == 0:
            named = [
                "the weights did not move. If the old log-probs carry a graph, logp - old is 0 and so is its "
                "gradient: compute them under torch.no_grad() (or .detach() them)"
            ]
        raise NotYet(
            f"{what}: the weights moved differently from the reference's (largest difference "
            f"{float((got - want).abs().max()):.3g}, largest move {float(want.abs().max()):.3g}). "
            + (
                named[0]
                if named
                else "check the forward (positions from the attention mask; the logits at t predict "
                "token t + 1), the loss and its divisors, backward per micro-batch and one optimizer step per iteration"
            )
        )
    return True


CHECKS.update({"10.1": _10_1, "10.2": _10_2, "10.3": _10_3, "10.4": _10_4})
QUIZZES["10.Q"] = [
    (
        "5c22ca423bcbc753",
        "Section 5: at the first iteration the old log-probs come from the very weights being trained.",
    ),
    ("fd02fdb63ecfd120", "Section 5: what is the gradient of exp(logp - old) when old is logp itself, graph and all?"),
    ("20b46d4dd59f5e73", "Section 3: dapo divides by the token count of the whole step, not of the micro-batch."),
]
CHECKS["10.Q"] = functools.partial(_quiz, "10.Q")
