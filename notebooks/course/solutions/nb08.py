"""Notebook 08 · when GRPO learns nothing: solutions."""

import torch

# 08.1: at the first iteration the ratio is 1, so each token's loss is -A of its completion, and dapo divides the sum
# over the step's tokens by their number. rewards [1, 0, 0, 0]: mean 0.25, unbiased std 0.5, so
# A = (0.75, -0.25, -0.25, -0.25) / (0.5 + 1e-4); lengths 2, 4, 4, 6 (16 tokens):
# loss = -(2 * 0.75 - (4 + 4 + 6) * 0.25) / 0.5001 / 16 = 2 / 0.5001 / 16, about 0.25. The advantages sum to 0, yet
# the loss is not 0: the long completions have the negative advantages (with equal lengths it would be 0).
std = 0.5 + 1e-4
loss_8_1 = -(2 * 0.75 - (4 + 4 + 6) * 0.25) / std / 16


# 08.2: pi_sampler(token) = pi(token) / (the mass of the top k) for a kept token, so pi / pi_sampler is that mass:
# the same for every token the sampler can draw, below 1 unless the top k hold everything.
def first_iteration_ratio(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1).topk(k, dim=-1).values.sum(dim=-1)  # (B,)


# 08.3: mean -19.975; deviations (-0.025, -0.025, -0.025, 0.075); unbiased std sqrt(0.0075 / 3) = 0.05.
# "group": 0.075 / (0.05 + 1e-4), about 1.497: a 0.1 difference becomes a full-size advantage. "none": 0.075.
largest_8_3 = (0.075 / (0.05 + 1e-4), 0.075)

# 08.Q: (1) c: ratio 1 and advantages that sum to 0 per group give a loss near 0 and a non-zero gradient. (2) a: chat
# messages go through the chat template, after which an instruct model says EOS. (3) b: on-policy clip_ratio is 0
# unless the sampler (a top-k or top-p) is not the softmax the log-probs describe.
selfcheck_08 = {1: "c", 2: "a", 3: "b"}

ANSWERS = {"08.1": loss_8_1, "08.2": first_iteration_ratio, "08.3": largest_8_3, "08.Q": selfcheck_08}
