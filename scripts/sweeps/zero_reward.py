"""A reward of 0 for every response: the task reward off, for pure distillation runs (docs/distillation.md#exact)."""


def compute_score(solution_str, ground_truth, extra_info=None):
    return 0.0
