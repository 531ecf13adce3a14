"""Notebook 02 · group advantages: solutions."""

import torch

# 02.1: a group of G = 4 binary rewards has zero spread when all succeed or all fail.
p, G = 0.3, 4
zero_spread_2_1 = p**G + (1 - p) ** G


# 02.2: the leave-one-out baseline: each completion is compared with the mean of the OTHER G - 1 rewards.
def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    grouped = rewards.view(-1, num_generations)  # (B/G, G)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)  # (B/G, G)
    return (grouped - others_mean).view(-1)  # (B,); equals G/(G-1) * (r - group mean)


# 02.Q: (1) all equal rewards: zero spread, advantages exactly 0 (b), not NaN: group_advantages forces them to 0.
# (2) mean 1, so the fourth gets 4 - 1 = 3, undivided. (3) The group's mean reward is the baseline (a): no critic.
selfcheck_02 = {1: "b", 2: 3, 3: "a"}

ANSWERS = {"02.1": zero_spread_2_1, "02.2": leave_one_out_advantages, "02.Q": selfcheck_02}
