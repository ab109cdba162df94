"""Building a RolloutBatch: prompts → engine (online) or dataset responses (offline)."""

from __future__ import annotations

import torch

from tether.rollout import response_mask_from_ids
from tether.trainer.batch import RolloutBatch
from tether.trainer.prompts import PromptSet, collate_prompts


class RolloutRunner:
    """Turns prompt indices into a RolloutBatch with ``n`` responses per prompt (contiguous groups)."""

    def __init__(self, engine, tokenizer, device, *, mode: str = "online", max_new_tokens: int = 256):
        self.engine = engine
        self.tok = tokenizer
        self.device = device
        self.mode = mode
        self.max_new_tokens = max_new_tokens

    def sync_weights(self, model) -> None:
        self.engine.sync_weights(model)

    def rollout(self, prompts: PromptSet, indices: list[int], n: int, **gen_overrides) -> RolloutBatch:
        if self.mode == "offline":
            return self._offline(prompts, indices)
        rep = [i for i in indices for _ in range(n)]
        prompt_ids, prompt_mask = collate_prompts([prompts.ids[i] for i in rep], self.tok.pad_token_id, self.device)
        response_ids = self.engine.generate(prompt_ids, prompt_mask, **gen_overrides)
        group_ids = torch.arange(len(indices), device=self.device).repeat_interleave(n)
        return self._batch(prompts, rep, prompt_ids, prompt_mask, response_ids, group_ids)

    def _offline(self, prompts: PromptSet, indices: list[int]) -> RolloutBatch:
        """Responses from the dataset's response column; rows with the same prompt text form a group."""
        eos = self.tok.eos_token_id
        resp = []
        for i in indices:
            text = prompts.rows[i].response or ""
            ids = self.tok(text, add_special_tokens=False)["input_ids"][: self.max_new_tokens - 1] + [eos]
            resp.append(ids)
        T = max(len(r) for r in resp)
        response_ids = torch.full((len(resp), T), self.tok.pad_token_id, dtype=torch.long)
        for j, r in enumerate(resp):
            response_ids[j, : len(r)] = torch.tensor(r)
        prompt_ids, prompt_mask = collate_prompts([prompts.ids[i] for i in indices], self.tok.pad_token_id, self.device)
        texts = [prompts.texts[i] for i in indices]
        first = {}
        group_ids = torch.tensor([first.setdefault(t, len(first)) for t in texts], device=self.device)
        return self._batch(prompts, indices, prompt_ids, prompt_mask, response_ids.to(self.device), group_ids)

    def _batch(self, prompts: PromptSet, rep, prompt_ids, prompt_mask, response_ids, group_ids) -> RolloutBatch:
        response_mask = response_mask_from_ids(response_ids, self.tok.eos_token_id)
        shown = torch.where(response_mask.bool(), response_ids, self.tok.pad_token_id)
        responses = self.tok.batch_decode(shown, skip_special_tokens=True)
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
            group_ids=group_ids, rows=[prompts.rows[i] for i in rep], prompts=[prompts.texts[i] for i in rep], responses=responses,
        )  # fmt: skip
