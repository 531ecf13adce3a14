"""Notebook 09 · hands on: change the algorithm and train: solutions."""

import torch

import grpo_ssr


# 09.1: leave-one-out. The mean of the other G - 1 rewards is (sum - r_i) / (G - 1), so
# A_i = r_i - (sum - r_i) / (G - 1) = G / (G - 1) * (r_i - mean): GRPO's centred reward, scaled up, and not divided by
# any std. A group whose rewards are all equal gets exactly 0 (the division can leave a rounding error behind).
def loo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    grouped = rewards.view(-1, num_generations)  # (B/G, G)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    adv = torch.where(grpo_ssr.zero_spread_groups(rewards, num_generations)[:, None], 0.0, grouped - others)
    return adv.view(-1)


# 09.2: rank-based priority (as in rank-based prioritized replay): P(i) ~ 1 / rank(i), rank 1 for the largest |A|.
# Ties share the best rank (1 + the number of samples with a strictly larger |A|), so the rule does not depend on the
# order the samples are held in. Empty slots weigh 0; SSRReplayBuffer.add still turns zero advantages away.
class RankReplayBuffer(grpo_ssr.SSRReplayBuffer):
    @staticmethod
    def expected_probabilities(advantages: torch.Tensor) -> torch.Tensor:
        """(N,) advantages of the samples held -> (N,) the probability of drawing each."""
        size = advantages.abs().double()
        rank = 1 + (size[None, :] > size[:, None]).sum(dim=1)  # (N,)
        weights = 1.0 / rank.double()
        return weights / weights.sum()

    def _weights(self) -> torch.Tensor:
        held = [i for i, s in enumerate(self.slots) if s is not None]
        weights = torch.zeros(self.capacity, dtype=torch.float64)
        if held:
            advantages = torch.stack([torch.as_tensor(self.slots[i]["advantages"]).float().cpu() for i in held])
            weights[held] = self.expected_probabilities(advantages)
        return weights


# 09.3: a reward the random model rarely earns but can learn quickly: the share of the completion's characters that
# are lowercase letters (0 for an empty completion). The tiny model starts on random bytes.
def reward_lowercase(completions: list, **kwargs) -> list[float]:
    texts = [grpo_ssr.completion_text(c) for c in completions]
    return [sum(ch.islower() for ch in t) / len(t) if t else 0.0 for t in texts]


ANSWERS = {"09.1": loo_advantages, "09.2": RankReplayBuffer, "09.3": reward_lowercase}
