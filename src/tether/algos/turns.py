"""Multi-turn episodes over (B, T) tensors: where each turn ends, and per-turn rewards placed there.

A multi-turn response interleaves the model's tokens (``generated_mask`` 1) with tokens the environment
appended (a tool's output: ``generated_mask`` 0). A *turn* is a maximal run of consecutive model tokens; its
reward goes on its last model token, so that the return of every earlier model token (the return-to-go of
REINFORCE, GAE's λ-return: :mod:`tether.algos.advantages`, which skip masked tokens) includes it, and no later
token's does. An observation token is not an action: it gets no reward, no KL and no advantage.
"""

from __future__ import annotations

import torch

from .masked import as_bool_mask

__all__ = ["turn_end_mask", "place_turn_rewards"]


def turn_end_mask(action_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True at the last model token of each turn (a model token followed by a non-model token or by
    the end of the row).

    Args:
        action_mask: (B, T), non-zero = a counted token the model sampled (``RolloutBatch.action_mask``).

    Raises:
        ValueError: the mask is not (B, T).
    """
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must be (B, T), got {tuple(action_mask.shape)}")
    m = as_bool_mask(action_mask)
    after = torch.nn.functional.pad(m[:, 1:], (0, 1), value=False)  # (B, T): the next position is a model token
    return m & ~after


def place_turn_rewards(turn_rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Put reward k of row b on the last model token of row b's k-th turn.

    Args:
        turn_rewards: (B, K) per-turn rewards, reward units, turn k of row b at [b, k]; a row with fewer than K
            turns pads with 0.
        action_mask: (B, T), non-zero = a counted token the model sampled.

    Returns:
        (B, T) float (``turn_rewards``' dtype, float32 for integers), 0 everywhere but at turn ends. Pass it as
        ``turn_rewards`` to :func:`tether.algos.token_level_rewards_from_kl` with the same mask.

    Raises:
        ValueError: shapes do not fit, a reward is not finite, or row b has a non-zero reward for a turn k it does
            not have (naming b, k and its number of turns).
    """
    ends = turn_end_mask(action_mask)  # (B, T)
    if turn_rewards.dim() != 2 or turn_rewards.shape[0] != ends.shape[0]:
        raise ValueError(f"turn_rewards must be (B, K) with B = {ends.shape[0]}, got {tuple(turn_rewards.shape)}")
    dtype = turn_rewards.dtype if turn_rewards.is_floating_point() else torch.float32
    r = turn_rewards.to(device=ends.device, dtype=dtype)
    if not bool(torch.isfinite(r).all()):
        b, k = (int(i) for i in (~torch.isfinite(r)).nonzero()[0])
        raise ValueError(f"turn_rewards[{b}, {k}] = {float(r[b, k])} is not finite; give every turn a finite reward")
    n_turns = ends.sum(-1)  # (B,)
    k_idx = torch.arange(r.shape[1], device=r.device)[None, :]  # (1, K)
    extra = (k_idx >= n_turns[:, None]) & (r != 0)  # (B, K): a reward for a turn the row does not have
    if bool(extra.any()):
        b, k = (int(i) for i in extra.nonzero()[0])
        raise ValueError(
            f"turn_rewards row {b} has a reward for turn {k} but the row has {int(n_turns[b])} turn(s) of model "
            "tokens; give one reward per turn (0 to pad)"
        )
    turn_of = torch.cumsum(ends.long(), dim=-1) - ends.long()  # (B, T): the index of the turn a turn end closes
    k = turn_of.clamp(max=max(r.shape[1] - 1, 0))
    out = torch.zeros(ends.shape, dtype=dtype, device=ends.device)
    if r.shape[1] == 0:
        return out
    picked = r.gather(1, k)  # (B, T)
    return torch.where(ends & (turn_of < r.shape[1]), picked, out)
