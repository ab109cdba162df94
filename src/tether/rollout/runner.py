"""Building a RolloutBatch: prompts → engine (online) or dataset responses (offline)."""

from __future__ import annotations

import torch

from tether.batch import RolloutBatch
from tether.data.loading import PromptSet, collate_prompts
from tether.rollout import response_mask_from_ids, truncated_rows


class RolloutRunner:
    """Turns prompt indices into a RolloutBatch with ``n`` responses per prompt (contiguous groups)."""

    def __init__(
        self,
        engine,
        tokenizer,
        device,
        *,
        mode: str = "online",
        max_new_tokens: int = 256,
        eos_token_ids: list[int] | None = None,
    ):
        self.engine = engine
        self.tok = tokenizer
        self.device = device
        self.mode = mode
        self.max_new_tokens = max_new_tokens
        # every id that ends a response (tokenizer EOS + the model's generation_config EOS ids, e.g. Qwen2.5's
        # <|im_end|> and <|endoftext|>); a response's mask ends at the first of them
        self.eos_token_ids = list(dict.fromkeys([tokenizer.eos_token_id, *(eos_token_ids or [])]))
        self._offline_groups: tuple[PromptSet, list[list[int]], dict[int, int]] | None = None

    def sync_weights(self, model) -> None:
        self.engine.sync_weights(model)

    def rollout(
        self, prompts: PromptSet, indices: list[int], n: int, *, mode: str | None = None, **gen_overrides
    ) -> RolloutBatch:
        """``n`` sampled responses per prompt index (online), or the dataset's responses (offline).

        Args:
            prompts: the rendered prompt set; indices: rows of it.
            n: responses per prompt (online only; offline groups come from the data).
            mode: ``"online"``/``"offline"`` for this call (default: the runner's mode). Validation and
                ``tether eval`` always generate, also in an offline run.
            gen_overrides: passed to the engine's ``generate`` (e.g. ``do_sample=False``).
        """
        if (mode or self.mode) == "offline":
            return self._offline(prompts, indices)
        rep = [i for i in indices for _ in range(n)]
        prompt_ids, prompt_mask = collate_prompts([prompts.ids[i] for i in rep], self.tok.pad_token_id, self.device)
        rollout_logprobs = None
        # vLLM: its log-probs, to measure the mismatch with the trainer's
        if getattr(self.engine, "returns_logprobs", False):
            response_ids, rollout_logprobs = self.engine.generate(
                prompt_ids, prompt_mask, return_logprobs=True, **gen_overrides
            )
        else:
            response_ids = self.engine.generate(prompt_ids, prompt_mask, **gen_overrides)
        group_ids = torch.arange(len(indices), device=self.device).repeat_interleave(n)
        batch = self._batch(prompts, rep, prompt_ids, prompt_mask, response_ids, group_ids)
        batch.rollout_logprobs = rollout_logprobs
        return batch

    def _groups(self, prompts: PromptSet) -> tuple[list[list[int]], dict[int, int]]:
        """Row indices of ``prompts`` grouped by identical rendered prompt text (first-appearance
        order), and each row's group number. Cached for the last prompt set seen."""
        if self._offline_groups is None or self._offline_groups[0] is not prompts:
            by_text: dict[str, list[int]] = {}
            for i, t in enumerate(prompts.texts):
                by_text.setdefault(t, []).append(i)
            groups = list(by_text.values())
            self._offline_groups = (prompts, groups, {i: g for g, members in enumerate(groups) for i in members})
        return self._offline_groups[1], self._offline_groups[2]

    def _offline(self, prompts: PromptSet, indices: list[int]) -> RolloutBatch:
        """The dataset's responses for the sampled rows, each with its whole group.

        Every sampled row brings all rows with the same rendered prompt (its group: e.g. the four
        model solutions of one GSM8K question), so GRPO/RLOO baselines see complete groups whatever
        the shuffling; a group sampled twice in one batch appears once. A step thus holds up to
        ``data.batch_size`` prompts with all their responses (``rollout.n`` is not used).

        Responses are tokenized without special tokens and end with EOS, like a generated response
        that stopped; one longer than ``rollout.max_new_tokens`` is cut to that length without EOS
        (like a generated response that hit the limit).
        """
        groups, group_of = self._groups(prompts)
        chosen = list(dict.fromkeys(group_of[i] for i in indices))
        rows = [i for g in chosen for i in groups[g]]
        eos = self.tok.eos_token_id
        resp = []
        for i in rows:
            ids = self.tok(prompts.rows[i].response or "", add_special_tokens=False)["input_ids"]
            resp.append(ids[: self.max_new_tokens] if len(ids) >= self.max_new_tokens else ids + [eos])
        T = max(len(r) for r in resp)
        response_ids = torch.full((len(resp), T), self.tok.pad_token_id, dtype=torch.long)
        for j, r in enumerate(resp):
            response_ids[j, : len(r)] = torch.tensor(r, dtype=torch.long)
        prompt_ids, prompt_mask = collate_prompts([prompts.ids[i] for i in rows], self.tok.pad_token_id, self.device)
        group_ids = torch.tensor([k for k, g in enumerate(chosen) for _ in groups[g]], device=self.device)
        return self._batch(prompts, rows, prompt_ids, prompt_mask, response_ids.to(self.device), group_ids)

    def _batch(self, prompts: PromptSet, rep, prompt_ids, prompt_mask, response_ids, group_ids) -> RolloutBatch:
        response_mask = response_mask_from_ids(response_ids, self.eos_token_ids)
        shown = torch.where(response_mask.bool(), response_ids, self.tok.pad_token_id)
        responses = self.tok.batch_decode(shown, skip_special_tokens=True)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            group_ids=group_ids,
            rows=[prompts.rows[i] for i in rep],
            prompts=[prompts.texts[i] for i in rep],
            responses=responses,
            truncated=truncated_rows(response_ids, self.eos_token_ids),
        )
