"""Notebook 01 · generation and reward: solutions."""

import math

import torch

# 01.1: "naïve TL;DR" is 11 characters, but ï is two bytes in UTF-8, and the byte tokenizer has one token a byte.
tokens_1 = len("naïve TL;DR".encode("utf-8"))

# 01.2: keep every token up to and including the first EOS (256); a row without EOS is kept whole.
mask_2 = [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]

# 01.3: softmax(logits / T) of the first token at T = 0.5 and T = 0.05.
logits = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64)
probs_3 = tuple(torch.softmax(logits / T, dim=0)[0].item() for T in (0.5, 0.05))
# As T -> 0 one token takes all the mass: the G completions of a group become identical, so do their rewards, and
# the group's advantages vanish (notebook 02).

# 01.Q: (1) 3 prompts x G = 8 are 24 rows, and prompt i's group starts at row i * G, so prompt 2's at 16. (2) Left
# padding puts every row's last prompt token in the same column, so each forward appends the new tokens of all rows
# in one column. (3) reward_len is -|20 - characters|: 14 characters give -6.
selfcheck_01 = {1: (24, 16), 2: "c", 3: -6}

ANSWERS = {"01.1": tokens_1, "01.2": mask_2, "01.3": probs_3, "01.Q": selfcheck_01}
assert math.isclose(probs_3[0], 0.8668, abs_tol=1e-4)
