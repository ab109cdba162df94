"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, sec. 3.4, eq. 13; verl's ``overlong_buffer``).

A response cut at the length limit is scored as if it had ended there, although its answer may
simply be missing; DAPO instead lowers the score of responses that come close to the limit,
linearly over the last ``buffer`` tokens, so the policy learns to stay short of it.
"""

from __future__ import annotations

import torch

__all__ = ["overlong_penalty"]


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's length-aware penalty, added to each response's score.

    With L_max = ``max_len``, L_cache = ``buffer`` and |y| = ``lengths``::

        R_length(y) = 0                                   |y| ≤ L_max − L_cache
                    = ((L_max − L_cache) − |y|) / L_cache   L_max − L_cache < |y| ≤ L_max
                    = −1                                  L_max < |y|

    times ``factor`` (verl's ``overlong_penalty_factor``): 0 up to the start of the buffer, then
    falling linearly to −factor at the limit. verl's DAPO reward manager computes the middle line
    and clips it at 0 (its responses never pass L_max); the third line is the paper's.

    Args:
        lengths: (B,) response lengths in tokens, the EOS counted where there is one (the counted
            tokens of ``response_mask``, verl's ``valid_response_length``); any numeric dtype.
        max_len: L_max ≥ 1, tokens (``rollout.max_new_tokens``).
        buffer: L_cache, tokens, 1 ≤ L_cache < L_max (``reward.overlong_buffer``).
        factor: the penalty at the limit, ≥ 0 (``reward.overlong_penalty``), in score units.

    Returns:
        (B,) float32 penalties ≤ 0, in score units.

    Raises:
        ValueError: ``max_len`` < 1, ``buffer`` outside [1, max_len), ``factor`` < 0 or not finite.
    """
    if isinstance(max_len, bool) or int(max_len) != max_len or max_len < 1:
        raise ValueError(f"max_len must be an integer >= 1, got {max_len!r}")
    if isinstance(buffer, bool) or int(buffer) != buffer or not 1 <= buffer < max_len:
        raise ValueError(f"buffer must be an integer with 1 <= buffer < max_len ({max_len}), got {buffer!r}")
    factor = float(factor)
    if not (factor >= 0 and factor != float("inf")):
        raise ValueError(f"factor must be a finite number >= 0, got {factor!r}")
    length = lengths.to(torch.float32)
    expected = float(max_len - buffer)
    ramp = (expected - length) / float(buffer)  # > -1 inside the buffer, 0 at its start
    penalty = torch.where(length > float(max_len), torch.full_like(length, -1.0), torch.clamp(ramp, max=0.0))
    return penalty * factor
