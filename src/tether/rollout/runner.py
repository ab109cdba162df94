"""Building a RolloutBatch: prompts → trajectories through a generation engine (online), or the dataset's responses
(offline).

A :class:`Trajectory` is one response as it grows: the prompt, then turns. Each turn appends what the engine
sampled (``generated_mask`` 1, with the engine's log-probs); a multi-turn runner may then append tokens of its
own (a tool's output, a user's reply: ``generated_mask`` 0) and ask for another turn (:meth:`RolloutRunner.next_turn`).
Single-turn sampling is that loop run once. The batch's ``loss_mask`` starts from ``generated_mask``: the update
trains only on tokens the model wrote; ``response_mask`` says which positions hold a token at all.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from tether.batch import RolloutBatch
from tether.data.loading import PromptSet
from tether.rollout.engine import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams, left_pad


@dataclass
class Trajectory:
    """One response being built after its prompt.

    Attributes:
        prompt_ids: the prompt's token ids.
        response_ids: every token after the prompt, in order: the engine's and (multi-turn) the environment's.
        generated_mask: per response token, 1 where the engine sampled it, 0 where anything else put it.
        logprobs: per response token, the engine's log-prob of a sampled token (nats; NaN where it reported none),
            0.0 for a token it did not sample; None when the engine was not asked for them.
        finish_reason: why the last turn ended (``tether.rollout.engine.FINISH_REASONS``); None before any turn.
        turns: engine calls made for it.
        turn_ends: per turn, the index in ``response_ids`` of the turn's last model token (-1 for a turn that
            sampled nothing): where a per-turn reward sits.
        turn_rewards: per turn, the environment's reward for it (0.0 where it gave none); empty for single-turn
            sampling.
        error: why the trajectory failed (a multi-turn environment's ``reset``/``step`` raised; one line naming the
            sample and turn), None if it did not: a failed trajectory takes no more turns and is dropped from the
            batch (the trainer counts it).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    generated_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    turns: int = 0
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def context(self) -> list[int]:
        """What the next turn continues: the prompt and everything after it, exactly as the model saw it."""
        return [*self.prompt_ids, *self.response_ids]

    def add_generated(self, result: GenerationResult) -> None:
        """Append one turn's sampled tokens (``generated_mask`` 1) and its log-probs."""
        n = len(result.token_ids)
        if result.logprobs is not None and self.logprobs is None:
            self.logprobs = [0.0] * len(self.response_ids)
        if self.logprobs is not None:
            self.logprobs += result.logprobs if result.logprobs is not None else [float("nan")] * n
        self.response_ids += result.token_ids
        self.generated_mask += [1] * n
        self.finish_reason = result.finish_reason
        self.turns += 1
        self.turn_ends.append(len(self.response_ids) - 1 if n else -1)

    def add_observation(self, token_ids: list[int]) -> None:
        """Append tokens the model did not write (``generated_mask`` 0, log-prob 0.0): a tool's output, a reply."""
        self.response_ids += list(token_ids)
        self.generated_mask += [0] * len(token_ids)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(token_ids)


class RolloutRunner:
    """Turns prompt indices into a RolloutBatch with ``n`` responses per prompt (contiguous groups).

    Args:
        engine: the generation engine (:class:`~tether.rollout.engine.GenerationEngine`).
        tokenizer: the policy's tokenizer (pad id, EOS id, decoding).
        device: where the batch's tensors go.
        params: the run's sampling settings (``tether.rollout.registry.sampling_params``); ``logprobs`` asks the
            engine for the sampled tokens' log-probs (``batch.rollout_logprobs``).
        mode: ``"online"`` (sample) or ``"offline"`` (the dataset's responses).
        eos_token_ids: every id that ends a response besides the tokenizer's (the model's generation_config EOS
            ids, e.g. Qwen2.5's <|im_end|> and <|endoftext|>); offline responses end with the tokenizer's.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer,
        device,
        *,
        params: SamplingParams,
        mode: str = "online",
        eos_token_ids: list[int] | None = None,
    ):
        self.engine = engine
        self.tok = tokenizer
        self.device = device
        self.params = params
        self.mode = mode
        self.eos_token_ids = list(dict.fromkeys([tokenizer.eos_token_id, *(eos_token_ids or [])]))
        self._offline_groups: tuple[PromptSet, list[list[int]], dict[int, int]] | None = None

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    def sync_weights(self, model) -> None:
        """The engine takes the policy's weights (after an update, a resume or a rollback)."""
        self.engine.sync_weights(model)

    def fork(self, engine) -> RolloutRunner:
        """A copy of this runner over ``engine``, with a tokenizer of its own, for another thread (the async
        rollout's job): it may decode while this one's tokenizer is in use (a fast tokenizer refuses concurrent
        use)."""
        other = copy.copy(self)
        other.engine = engine
        other.tok = copy.deepcopy(self.tok)
        return other

    def rollout(
        self, prompts: PromptSet, indices: list[int], n: int, *, mode: str | None = None, **overrides
    ) -> RolloutBatch:
        """``n`` sampled responses per prompt index (online), or the dataset's responses (offline).

        Args:
            prompts: the rendered prompt set; indices: rows of it.
            n: responses per prompt (online only; offline groups come from the data).
            mode: ``"online"``/``"offline"`` for this call (default: the runner's mode). Validation and
                ``tether eval`` always generate, also in an offline run.
            overrides: sampling settings for this call (:meth:`SamplingParams.override`, e.g. ``do_sample=False``).
        """
        if (mode or self.mode) == "offline":
            return self._offline(prompts, indices)
        rep = [i for i in indices for _ in range(n)]
        trajectories = self.run(
            [prompts.ids[i] for i in rep], self.params.override(**overrides), rows=[prompts.rows[i] for i in rep]
        )
        group_ids = torch.arange(len(indices), device=self.device).repeat_interleave(n)
        return self.collate(prompts, rep, trajectories, group_ids)

    def run(self, prompt_ids: list[list[int]], params: SamplingParams, rows: list | None = None) -> list[Trajectory]:
        """The turn loop: every unfinished trajectory's context goes to the engine in one call per turn; after each
        turn :meth:`next_turns` says whether (and with what tokens appended) each trajectory continues. ``rows``
        (the dataset rows, one per prompt) go to :meth:`begin`, which a multi-turn runner uses; :meth:`end` sees the
        finished trajectories."""
        trajectories = [Trajectory(list(p)) for p in prompt_ids]
        self.begin(trajectories, rows)
        active = [i for i, t in enumerate(trajectories) if t.error is None]  # a failed reset takes no turn
        while active:
            results = self.engine.generate([GenerationRequest(trajectories[i].context, params) for i in active])
            if len(results) != len(active):
                raise RuntimeError(
                    f"rollout.engine={self.engine.name}: {len(results)} results for {len(active)} requests"
                )
            for i, result in zip(active, results, strict=True):
                trajectories[i].add_generated(result)
            still = []
            for i, appended in zip(active, self.next_turns([trajectories[i] for i in active]), strict=True):
                if appended is not None and trajectories[i].error is None:
                    trajectories[i].add_observation(appended)
                    still.append(i)
            active = still
        self.end(trajectories)
        return trajectories

    def begin(self, trajectories: list[Trajectory], rows: list | None) -> None:
        """Before the first turn (single-turn sampling: nothing); a multi-turn runner sets up its environments."""

    def end(self, trajectories: list[Trajectory]) -> None:
        """After the last turn (single-turn sampling: nothing); a multi-turn runner checks and counts."""

    def next_turns(self, trajectories: list[Trajectory]) -> list[list[int] | None]:
        """After a turn of every trajectory in ``trajectories``: :meth:`next_turn` of each (a multi-turn runner may
        step its environments together)."""
        return [self.next_turn(t) for t in trajectories]

    def next_turn(self, trajectory: Trajectory) -> list[int] | None:
        """After a turn: None ends ``trajectory`` (single-turn sampling: always); a multi-turn runner returns the
        token ids to append before the next turn (a tool's output; ``generated_mask`` 0)."""
        return None

    def collate(self, prompts: PromptSet, rep: list[int], trajectories: list[Trajectory], group_ids) -> RolloutBatch:
        """The batch of ``trajectories`` (row j answers prompt ``rep[j]``): prompts left-padded, responses
        right-padded with the pad token, ``response_mask`` 1 on every response token, ``generated_mask`` 1 on the
        sampled ones (``loss_mask`` starts from it), ``rollout_logprobs`` the engine's (0 on padding), the
        finish reasons and ``truncated`` (finished by length)."""
        pad = self.tok.pad_token_id
        prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajectories], pad, self.device)
        B = len(trajectories)
        T = max(1, max(len(t.response_ids) for t in trajectories))
        response_ids = torch.full((B, T), pad, dtype=torch.long)
        response_mask = torch.zeros((B, T), dtype=torch.long)
        generated = torch.zeros((B, T), dtype=torch.long)
        with_lp = any(t.logprobs is not None for t in trajectories)
        logprobs = torch.zeros((B, T), dtype=torch.float32) if with_lp else None
        for j, t in enumerate(trajectories):
            k = len(t.response_ids)
            if not k:
                continue
            response_ids[j, :k] = torch.as_tensor(t.response_ids, dtype=torch.long)
            response_mask[j, :k] = 1
            generated[j, :k] = torch.as_tensor(t.generated_mask, dtype=torch.long)
            if logprobs is not None:
                logprobs[j, :k] = torch.as_tensor(t.logprobs if t.logprobs is not None else [float("nan")] * k)
        shown = torch.where(response_mask.bool(), response_ids, pad)
        finish = [t.finish_reason or "length" for t in trajectories]
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids.to(self.device),
            response_mask=response_mask.to(self.device),
            group_ids=group_ids,
            rows=[prompts.rows[i] for i in rep],
            prompts=[prompts.texts[i] for i in rep],
            responses=self.tok.batch_decode(shown, skip_special_tokens=True),
            rollout_logprobs=None if logprobs is None else logprobs.to(self.device),
            truncated=torch.tensor([f == "length" for f in finish], device=self.device),
            generated_mask=generated.to(self.device),
            loss_mask=generated.bool().to(self.device),
            finish_reasons=finish,
        )

    def restore(
        self,
        prompts: PromptSet,
        rep: list[int],
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        group_ids: torch.Tensor,
        *,
        response_mask: torch.Tensor | None = None,
        generated_mask: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        saved: dict | None = None,
    ) -> RolloutBatch:
        """A batch saved as tensors (a pending async batch, on resume), rebuilt as :meth:`collate` built it.

        Without ``response_mask`` (a checkpoint written before ``generated_mask`` existed) each row is its tokens up
        to and including the first EOS id (``eos``), else the whole row (``length``), every one generated: what a
        single-turn batch holds. ``saved``: what :meth:`saved_extra` took from the batch (single-turn: nothing).
        """
        eos = set(self.eos_token_ids)
        trajectories = []
        for j, (p, pm, row) in enumerate(
            zip(prompt_ids.tolist(), prompt_mask.tolist(), response_ids.tolist(), strict=True)
        ):
            end = next((t + 1 for t, tok in enumerate(row) if tok in eos), None)
            k = int(response_mask[j].sum()) if response_mask is not None else (len(row) if end is None else end)
            gen = [1] * k if generated_mask is None else [int(g) for g in generated_mask[j, :k].tolist()]
            cut = bool(truncated[j]) if truncated is not None else end is None
            t = Trajectory([x for x, m in zip(p, pm, strict=True) if m], row[:k], gen, None, "length" if cut else "eos")
            t.turns = 1
            trajectories.append(t)
        return self.collate_restored(prompts, rep, trajectories, group_ids.to(self.device), saved or {})

    def collate_restored(self, prompts, rep, trajectories, group_ids, saved: dict) -> RolloutBatch:
        """:meth:`restore`'s batch of rebuilt ``trajectories`` and the ``saved`` parts of :meth:`saved_extra`."""
        return self.collate(prompts, rep, trajectories, group_ids)

    def saved_extra(self, batch: RolloutBatch) -> tuple[dict[str, torch.Tensor], dict]:
        """What a checkpoint keeps of ``batch.extra`` for :meth:`restore` besides the batch's tensors: (tensors,
        JSON-able values). Single-turn: nothing."""
        return {}, {}

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
        that stopped (``eos``); one longer than ``rollout.max_new_tokens`` is cut to that length without EOS
        (like a generated response that hit the limit: ``length``); a response ends at its first EOS id. Its tokens
        count as the policy's actions
        (``generated_mask`` 1): offline RL trains on them as if the policy had sampled them.
        """
        groups, group_of = self._groups(prompts)
        chosen = list(dict.fromkeys(group_of[i] for i in indices))
        rows = [i for g in chosen for i in groups[g]]
        limit, ends = self.max_new_tokens, set(self.eos_token_ids)
        trajectories = []
        for i in rows:
            ids = self.tok(prompts.rows[i].response or "", add_special_tokens=False)["input_ids"]
            ids = ids[:limit] if len(ids) >= limit else [*ids, self.tok.eos_token_id]
            end = next((t + 1 for t, tok in enumerate(ids) if tok in ends), None)  # a response ends at its first EOS
            t = Trajectory(list(prompts.ids[i]))
            t.add_generated(
                GenerationResult(ids if end is None else ids[:end], None, "length" if end is None else "eos")
            )
            trajectories.append(t)
        group_ids = torch.tensor([k for k, g in enumerate(chosen) for _ in groups[g]], device=self.device)
        return self.collate(prompts, rows, trajectories, group_ids)
