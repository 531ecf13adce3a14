"""Notebook 07 · on a GPU: solutions."""

# 07.Q: (1) b: HeadLogProbs' backward rebuilds one chunk of logits at a time. (2) b: log-probs at another temperature
# describe a distribution the tokens were not drawn from, so the ratio is not 1. (3) a: pick_device, once.
selfcheck_07 = {1: "b", 2: "b", 3: "a"}

ANSWERS = {"07.Q": selfcheck_07}
