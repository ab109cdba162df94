"""Rollout with Hugging Face ``generate``: the CPU path and the default engine."""

from __future__ import annotations

import torch


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """(B, T) 1 for response tokens up to and including the first EOS, 0 after it.

    A row without EOS was truncated at the length limit: all its tokens count.
    """
    eos = torch.as_tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id], device=response_ids.device)
    is_eos = torch.isin(response_ids, eos).long()  # (B, T)
    # tokens strictly after the first EOS have a cumulative EOS count >= 1 excluding themselves
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after_eos).long()


class HFRolloutEngine:
    """Samples responses with ``model.generate`` from left-padded prompts.

    Sampling uses softmax(logits / temperature), nucleus ``top_p`` and optional ``top_k``; the
    trainer recomputes log-probs with the same temperature, so the ratio π_θ/π_old is exact when
    top_p = 1 and top_k = 0.
    """

    def __init__(
        self, model, tokenizer, *, temperature: float, top_p: float, top_k: int, max_new_tokens: int, do_sample: bool = True,
        eos_token_ids: list[int] | None = None, compute_dtype: str = "float32",
    ):  # fmt: skip
        self.model = model
        self.compute_dtype = compute_dtype  # generation runs under the actor's autocast (actor.compute_dtype)
        self.tokenizer = tokenizer
        # generation stops at any of these (the tokenizer's EOS and the model's generation_config EOS ids)
        self.eos_token_ids = list(dict.fromkeys([tokenizer.eos_token_id, *(eos_token_ids or [])]))
        self.kwargs = dict(
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            top_p=top_p if do_sample else None,
            top_k=top_k if do_sample else None,
            max_new_tokens=max_new_tokens,
        )

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **overrides) -> torch.Tensor:
        """Sample one response per row. prompt_ids, prompt_mask: (B, P). Returns response_ids (B, T), T ≤ max_new_tokens,
        padded with the pad token after EOS."""
        was_training = self.model.training
        self.model.eval()
        kwargs = {**self.kwargs, **overrides}
        from tether.models import autocast

        with autocast(prompt_ids.device, self.compute_dtype):
            out = self._generate(prompt_ids, prompt_mask, kwargs)
        if was_training:
            self.model.train()
        return out[:, prompt_ids.shape[1] :]

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, kwargs: dict) -> torch.Tensor:
        return self.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.eos_token_ids,
            use_cache=True,
            **kwargs,
        )

    def sync_weights(self, model) -> None:
        """The HF engine shares the actor's module: nothing to push."""
        self.model = model
