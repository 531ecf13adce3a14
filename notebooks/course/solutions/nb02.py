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


ANSWERS = {"02.1": zero_spread_2_1, "02.2": leave_one_out_advantages}
