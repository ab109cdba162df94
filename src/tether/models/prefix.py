"""Shared-prompt forward passes for GRPO groups (``actor.share_prompt_prefix``).

In GRPO every group of ``rollout.n`` responses answers one prompt, yet an ordinary forward pass runs
that prompt's P tokens once per response. Here a micro-batch's distinct prompts run once (a batch of
U ≤ B prompts, ``use_cache``), each prompt's per-layer keys and values are expanded to its
responses' rows with an index select, and only the response tokens run, attending to that cache.
A causal model's prompt states do not depend on the response, so the log-probs are those of the
ordinary pass up to float round-off; in the update's backward the expanded cache's index select sums
each group's gradients into the one prompt forward (autograd), so the gradients are exact as well.

The prompt pass runs
the prompts but their last token; the second pass runs each row's last prompt token and its first
T - 1 response tokens (the last response token is only scored, never an input), so all T scoring
positions come out of one (B, T) call. The actor's and the reference's passes are then bitwise equal
when their weights are, and a row's log-probs do not depend on which prompts share its micro-batch
(``tests/workers/test_prefix.py``; issue 13: a one-row matmul, as a (U = 1, 1, H) last-position head
call was, takes a matrix-vector kernel that rounds differently from the many-row one, and so does torch's
matmul on a strided (U, 1, H) input when the weight does not require grad; dropping the prompt columns
that are padding in every row of a micro-batch changed the rounding too, so all P columns run).

The same idea is "shared prefix" batching in RL trainers and inference engines (e.g. vLLM's prefix
caching for generation); here it serves the no-grad log-prob passes and the update's forward and
backward. Falls back to the ordinary pass (:func:`tether.models.response_logprobs`) where it cannot
help or is not valid: no prompt repeats in the micro-batch; gradient checkpointing in a grad pass
(Hugging Face's checkpointed layers drop the cache); a model with sliding-window or non-attention
layers (:func:`supports_prefix_sharing`).
"""

from __future__ import annotations

import torch
from torch import nn

from tether.algos import logprobs_and_entropy_from_logits
from tether.models.forward import _forward_params, autocast, position_ids_from_mask, response_logprobs


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The distinct prompts of a micro-batch, whatever the rows' order.

    Two rows share a prompt when their valid prompt tokens and their padding are identical (the
    comparison is on the ids with padding replaced by -1, so a pad id equal to a real token id
    cannot merge two prompts).

    Args:
        prompt_ids, prompt_mask: (B, P), left-padded; mask 1 = real prompt token.
    Returns:
        ``(first, inverse)``: ``first`` (U,) int64, the first row holding each distinct prompt;
        ``inverse`` (B,) int64, each row's index into ``first`` (row b's prompt is row
        ``first[inverse[b]]``'s). ``None`` when every prompt is distinct (U == B: nothing to share), or when
        the shared prompt pass would hold fewer than 2 tokens (U·(P − 1) < 2: its matmuls would then take
        a one-row kernel that rounds differently).
    """
    if prompt_ids.shape != prompt_mask.shape or prompt_ids.dim() != 2:
        raise ValueError(
            f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} must be the same (B, P)"
        )
    b = prompt_ids.shape[0]
    if b < 2:
        return None
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    u = int(inverse.max()) + 1
    if u == b or u * (prompt_ids.shape[1] - 1) < 2:
        return None
    rows = torch.arange(b, device=inverse.device)
    first = torch.full((u,), b, dtype=torch.long, device=inverse.device).scatter_reduce(0, inverse, rows, reduce="amin")
    # renumber the groups by first occurrence, so the prompt batch keeps the rows' order
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(u, device=order.device)
    return first[order], rank[inverse]


def supports_prefix_sharing(model: nn.Module) -> bool:
    """Whether the model's cache is plain full attention in every layer (sliding-window and
    linear-attention layers keep other state, so they are run the ordinary way), and it is not a
    tensor-parallel (DTensor) model."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return False
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is None or type(head.weight).__name__ != "DTensor"


def _checkpointing(model: nn.Module) -> bool:
    """Whether Hugging Face gradient (activation) checkpointing is on (its name changed in transformers 5)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def _cache_kwarg(model: nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers ≥ 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in _forward_params(model) else "past_key_values"


def shared_prefix_outputs(
    forward,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    groups: tuple[torch.Tensor, torch.Tensor],
    compute_dtype: str = "float32",
) -> torch.Tensor:
    """The per-position outputs (logits or hidden states) that score the T response tokens, with each
    distinct prompt run once.

    Args:
        forward: ``forward(input_ids, attention_mask, position_ids, cache, last_only) -> (b, l, X)``, one
            call of the model with ``use_cache`` on ``cache`` (a ``DynamicCache``); ``last_only`` marks the
            prompt pass, whose outputs are not used (only the cache it fills), so it may compute the least.
        prompt_ids, prompt_mask (B, P), response_ids, response_mask (B, T), groups, compute_dtype: as
            :func:`shared_prefix_logprobs`.
    Returns:
        (B, T, X): row b's outputs at positions P-1 .. P+T-2 of ``cat([prompt, response])`` (position
        P-1+t predicts response token t), as one ordinary forward would give them.
    """
    from transformers import DynamicCache

    first, inverse = groups
    t = response_ids.shape[1]
    # the prompts but their last token (only the cache is kept). All P columns, even those that are padding in every
    # row: dropping them changes the rounding, so a row's log-probs would depend on its micro-batch's other prompts
    p_ids, p_mask = prompt_ids[first, :-1], prompt_mask[first, :-1]
    cache = DynamicCache()
    with autocast(prompt_ids.device, compute_dtype):
        forward(p_ids, p_mask, position_ids_from_mask(p_mask), cache, True)
    # (U, ...) -> (B, ...) per layer; an index select, so autograd sums the group's gradients
    cache.batch_select_indices(inverse)
    # the last prompt token runs with the response, so that every scoring position comes out of one (B, T) call:
    # its matmuls then see B·T ≥ 2 rows whatever the micro-batch's grouping, and round as in any other micro-batch
    # (one row, U = 1, would take a matrix-vector kernel that rounds differently: issue 13)
    # the last response token is only scored, never an input
    ids = torch.cat([prompt_ids[:, -1:], response_ids[:, : t - 1]], dim=1)
    mask = torch.cat([prompt_mask, response_mask[:, : t - 1]], dim=1)
    pos = position_ids_from_mask(mask)[:, -t:]  # as the ordinary pass numbers them
    with autocast(prompt_ids.device, compute_dtype):
        return forward(ids, mask, pos, cache, False)


def shared_prefix_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    groups: tuple[torch.Tensor, torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    return_logits: bool = False,
    compute_dtype: str = "float32",
):
    """Log-probs of the response tokens with each distinct prompt run once.

    Args:
        prompt_ids, prompt_mask: (B, P), left-padded.
        response_ids, response_mask: (B, T), right-padded (T ≥ 1: the micro-batch's trimmed length).
        groups: ``(first (U,), inverse (B,))`` from :func:`prompt_groups`.
        temperature, with_entropy, return_logits, compute_dtype: as :func:`tether.models.response_logprobs`.
    Returns:
        The same as :func:`tether.models.response_logprobs` on ``cat([prompt, response])``:
        (logprobs (B, T) nats, entropy (B, T) nats or None, logits (B, T, V) or None); equal to it up
        to float round-off (≤ 1e-5 in fp32, tested), gradients included.
    """
    name = _cache_kwarg(model)
    keep_last = "logits_to_keep" in _forward_params(model)

    def forward(ids, mask, pos, cache, last_only):
        kwargs = {"logits_to_keep": 1} if last_only and keep_last else {}  # the prompt pass: its logits are not used
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{name: cache}, **kwargs
        ).logits
        return logits[:, -1:, :] if last_only else logits

    # (B, T, V)
    logits = shared_prefix_outputs(forward, prompt_ids, prompt_mask, response_ids, response_mask, groups, compute_dtype)
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, response_ids, temperature, with_entropy=with_entropy)
    return logprobs, entropy, (logits if return_logits else None)


def shared_prefix_values(
    backbone: nn.Module, value_head: nn.Module, prompt_ids, prompt_mask, response_ids, response_mask, groups
) -> torch.Tensor:
    """The critic's V(s_t) (B, T) with each distinct prompt run once (:meth:`tether.models.ValueModel.forward`
    with ``shared``); arguments as :func:`shared_prefix_logprobs`, ``backbone`` an ``AutoModel``."""
    name = _cache_kwarg(backbone)

    def forward(ids, mask, pos, cache, last_only):
        hidden = backbone(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{name: cache}
        ).last_hidden_state
        return hidden[:, -1:, :] if last_only else hidden

    hidden = shared_prefix_outputs(forward, prompt_ids, prompt_mask, response_ids, response_mask, groups)  # (B, T, H)
    return value_head(hidden).squeeze(-1).float()


def micro_batch_values(
    value_model: nn.Module,
    mb,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    share_prefix: bool,
):
    """One micro-batch's V(s_t) (B, T): :func:`shared_prefix_values` where ``share_prefix`` is set and it
    applies (as :func:`micro_batch_logprobs` decides), else ``value_model(input_ids, attention_mask, T)``."""
    if share_prefix and _can_share(value_model.backbone):
        groups = prompt_groups(mb.prompt_ids, mb.prompt_mask)
        if groups is not None:
            t = response_len  # through the module's own call (FSDP2's hooks on the root)
            return value_model(
                input_ids,
                attention_mask,
                t,
                shared=(mb.prompt_ids, mb.prompt_mask, mb.response_ids[:, :t], mb.response_mask[:, :t], groups),
            )
    return value_model(input_ids, attention_mask, response_len)


def _can_share(model: nn.Module) -> bool:
    # HF's checkpointed layers drop the cache
    checkpointed = model.training and torch.is_grad_enabled() and _checkpointing(model)
    return supports_prefix_sharing(model) and not checkpointed


def micro_batch_logprobs(
    model: nn.Module,
    mb,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    share_prefix: bool,
    temperature: float = 1.0,
    with_entropy: bool = False,
    return_logits: bool = False,
    compute_dtype: str = "float32",
):
    """One micro-batch's response log-probs: shared-prompt (:func:`shared_prefix_logprobs`) where
    ``share_prefix`` is set and it applies, else the ordinary :func:`tether.models.response_logprobs`.

    Args:
        mb: the micro-batch (a :class:`tether.batch.RolloutBatch`, for its prompt and response tensors).
        input_ids, attention_mask, response_len: ``trim(mb)``, for the ordinary pass.
    Returns:
        (logprobs (B, T), entropy (B, T) or None, logits (B, T, V) or None), T = ``response_len``.
    """
    kw = dict(
        temperature=temperature, with_entropy=with_entropy, return_logits=return_logits, compute_dtype=compute_dtype
    )
    if share_prefix and _can_share(model):
        groups = prompt_groups(mb.prompt_ids, mb.prompt_mask)
        if groups is not None:
            t = response_len
            return shared_prefix_logprobs(
                model, mb.prompt_ids, mb.prompt_mask, mb.response_ids[:, :t], mb.response_mask[:, :t], groups, **kw
            )
    return response_logprobs(model, input_ids, attention_mask, response_len, **kw)
