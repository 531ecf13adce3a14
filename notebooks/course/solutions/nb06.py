"""Notebook 06 · a real model learns sums: solutions."""

import re
from typing import Callable, Optional

import grpo_ssr

# 06.1: six completions to "7 + 5 =" (answer 12). reward_accuracy reads the first number: "12", "The answer is 12."
# and "12 apples and 3 pears" start with 12; "7 + 5 = 12" starts with 7, "13, no wait, 12" with 13, and "twelve" has
# none. The lenient rule takes 12 anywhere, so it also accepts the restated question and the corrected guess.
COMPLETIONS_6_1 = ["12", "7 + 5 = 12", "The answer is 12.", "12 apples and 3 pears", "13, no wait, 12", "twelve"]
first_number_6_1 = sum(grpo_ssr.reward_accuracy(COMPLETIONS_6_1, answer=[12] * 6))
anywhere_6_1 = sum(12.0 in [float(x) for x in grpo_ssr.FIRST_NUMBER.findall(c)] for c in COMPLETIONS_6_1)
totals_6_1 = (int(first_number_6_1), int(anywhere_6_1))

# 06.2: a strict reader: the whole completion is one number, with nothing around it but whitespace and one final
# period. Restating the question, explaining, or listing numbers then scores nothing. The digits are [0-9], not \d:
# in Python's re, \d matches the digits of every script ("１２", full-width), and float() reads those, "1e1", "nan",
# "+5" and "1_000" too, none of them a number written out.
STRICT_NUMBER = re.compile(r"\s*(-?[0-9]+(?:\.[0-9]+)?)\.?\s*")


def strict_answer(text: str) -> Optional[float]:
    match = STRICT_NUMBER.fullmatch(text)
    return float(match.group(1)) if match else None


# 06.3: the share of groups whose rewards are all equal, from the completions themselves: score them with the reward
# function (TRL's signature, the answer column one per completion), cut into groups of G, and compare max with min.
def zero_spread_share(
    completions: list, answers: list, num_generations: int, reward_func: Callable = grpo_ssr.reward_accuracy
) -> float:
    rewards = reward_func(completions=completions, answer=answers)
    groups = [rewards[i : i + num_generations] for i in range(0, len(rewards), num_generations)]
    return sum(max(g) == min(g) for g in groups) / len(groups)


# 06.Q: (1) two groups a step: 0, 1/2 or 1 (b). (2) mean 2/8 = 0.25, so a right answer gets 1 - 0.25 = 0.75.
# (3) replay was not shown to beat plain GRPO on this model, and SSR lost to DAPO (c): notebooks/study/README.md.
selfcheck_06 = {1: "b", 2: 0.75, 3: "c"}

ANSWERS = {"06.1": totals_6_1, "06.2": strict_answer, "06.3": zero_spread_share, "06.Q": selfcheck_06}
assert totals_6_1 == (3, 5)
