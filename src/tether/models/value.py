"""The critic's value model: a Hugging Face backbone with a scalar value head."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tether.config import ConfigError
from tether.models import prefix
from tether.models.forward import position_ids_from_mask
from tether.models.loading import _LOAD_ERRORS, DTYPES


class ValueModel(nn.Module):
    """Critic: a causal-LM backbone (``AutoModel``) with a scalar value head.

    ``forward`` returns V(s_t) for the response: (B, T), the value of the state before each response
    token (the hidden state at position P+t-1), in reward units. The state after the last token is
    terminal (GAE takes its value as 0), so the last token is never fed.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = self.make_head(hidden_size)

    @staticmethod
    def make_head(hidden_size: int) -> nn.Linear:
        """The zero-initialised value head. nn.Linear's own initialisation draws from torch's global
        RNG before it is zeroed, so building the head advances that RNG (the Ray backend's driver,
        which holds no critic, builds one head too and samples as the local backend does)."""
        head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        return head

    @classmethod
    def from_pretrained(cls, path: Path, *, dtype: str = "float32", trust_remote_code: bool = False) -> ValueModel:
        from transformers import AutoModel

        try:
            backbone = AutoModel.from_pretrained(str(path), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
        except _LOAD_ERRORS as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConfigError(f"cannot load the critic backbone from {path}: {type(e).__name__}: {first}") from None
        return cls(backbone, backbone.config.hidden_size).to(DTYPES[dtype])

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        response_len: int,
        *,
        position_ids: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
        shared=None,
    ) -> torch.Tensor:
        """(B, T) V(s_t); or, with ``keep`` (packed (R, L) rows of ``tether.workers.packing.PackedLayout``:
        no attention mask, ``position_ids`` restarting per sequence), (N,) V at the N ``keep`` positions; or, with
        ``shared`` (actor.share_prompt_prefix: (prompt_ids, prompt_mask, response_ids, response_mask, groups)), (B, T)
        V(s_t) with each distinct prompt run once (``tether.models.prefix.shared_prefix_values``)."""
        if shared is not None:
            return prefix.shared_prefix_values(self.backbone, self.value_head, *shared)
        if keep is not None:
            out = self.backbone(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False)
            return self.value_head(out.last_hidden_state[keep]).squeeze(-1).float()  # (N,)
        # (B, P+T-1): V after the last token is unused
        ids_in, mask_in = input_ids[:, :-1].contiguous(), attention_mask[:, :-1].contiguous()
        out = self.backbone(
            input_ids=ids_in, attention_mask=mask_in, position_ids=position_ids_from_mask(mask_in), use_cache=False
        )
        hidden = out.last_hidden_state[:, -response_len:, :]  # (B, T, H)
        return self.value_head(hidden).squeeze(-1).float()  # (B, T)
