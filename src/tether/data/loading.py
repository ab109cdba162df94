"""Prompt datasets for the trainer: loading, rendering, up-front length checks, and a resumable sampler."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tether.config import EMBEDDED, ConfigError, DataConfig
from tether.data import (
    PromptRow,
    check_chat_template,
    has_chat_template,
    load_rows,
    render_prompt,
    rows_from_records,
    split_rows,
)
from tether.data.offline import filter_offline_rows, overlong_responses
from tether.tasks import embedded_task

log = logging.getLogger("tether")


@dataclass
class PromptSet:
    """Rendered, tokenized prompts (lists of ids, no padding) with their rows."""

    rows: list[PromptRow]
    texts: list[str]
    ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.rows)


def _embedded_rows(split: str, n: int, seed: int, task: str = "digitsum") -> list[PromptRow]:
    return rows_from_records(embedded_task(task).make_dataset(split, n, seed=seed), source=f"embedded:{split}")


def load_prompt_rows(cfg: DataConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train rows, val rows) from the data config. Raises DataError/ConfigError before training."""
    kwargs = dict(
        prompt_key=cfg.prompt_key, response_key=cfg.response_key, score_key=cfg.score_key, skip_invalid=cfg.skip_invalid
    )
    if cfg.train_files == EMBEDDED:
        train = _embedded_rows("train", cfg.embedded_train_size, seed, cfg.embedded_task)
    else:
        train = load_rows(cfg.train_files, **kwargs)
    if cfg.val_files == EMBEDDED or (cfg.val_files is None and cfg.train_files == EMBEDDED):
        val = _embedded_rows("val", cfg.embedded_val_size, seed, cfg.embedded_task)
    elif cfg.val_files is not None:
        # validation generates: no response/score columns
        val = load_rows(cfg.val_files, prompt_key=cfg.prompt_key, skip_invalid=cfg.skip_invalid)
    elif cfg.val_fraction > 0:
        train, val = split_rows(train, cfg.val_fraction, seed)
    else:
        val = []
    return train, val


def prepare_offline_rows(rows: list[PromptRow], tokenizer, cfg: DataConfig, max_new_tokens: int) -> list[PromptRow]:
    """Offline pairs that will be trained on: ``data.filter`` applied, then ``data.overlong_responses``
    (responses that do not fit ``rollout.max_new_tokens`` with their EOS); the counts are logged.

    Raises:
        ConfigError: an overlong response with ``data.overlong_responses=error`` (naming the rows), more
            than ``data.max_dropped_frac`` of the rows overlong with ``drop``, or no row left.
    """
    f = cfg.filter
    kept, counts = filter_offline_rows(
        rows, score_min=f.score_min, score_max=f.score_max, drop_empty=f.drop_empty, drop_duplicates=f.drop_duplicates
    )
    if counts.dropped:
        log.warning(
            "data.filter: dropped %d of %d offline rows: %s",
            counts.dropped,
            counts.total,
            counts.describe((f.score_min, f.score_max)),
        )
    long = overlong_responses(kept, tokenizer, max_new_tokens)
    if long:
        shown = ", ".join(f"{kept[i].where} ({n} tokens)" for i, n in long[:5])
        msg = (
            f"{len(long)} of {len(kept)} offline response(s) do not fit rollout.max_new_tokens={max_new_tokens} with "
            f"their EOS: {shown}"
        )
        mode = cfg.overlong_responses
        if mode == "error":
            raise ConfigError(msg + " (raise rollout.max_new_tokens, or set data.overlong_responses=drop or truncate)")
        if mode == "truncate":
            log.warning(
                "%s; they are cut there without an EOS and keep the whole response's score "
                "(data.overlong_responses=truncate)",
                msg,
            )
        elif len(long) > cfg.max_dropped_frac * len(kept):
            raise ConfigError(
                f"{msg}: dropping them would leave {len(kept) - len(long)} of {len(kept)} rows, more than "
                f"data.max_dropped_frac={cfg.max_dropped_frac:g} of the data gone; raise rollout.max_new_tokens, or "
                "set data.overlong_responses=truncate (or data.max_dropped_frac=1 to train on what is left)"
            )
        else:
            drop = {i for i, _ in long}
            kept = [r for i, r in enumerate(kept) if i not in drop]
            log.warning(
                "%s; dropped: a whole response's label does not belong to its prefix (data.overlong_responses=drop)",
                msg,
            )
    if not kept and rows:
        raise ConfigError(
            f"data.train_files: no offline row left of {len(rows)} after data.filter and data.overlong_responses"
        )
    return kept


def prepare_prompts(rows: list[PromptRow], tokenizer, cfg: DataConfig, what: str) -> PromptSet:
    """Render every prompt and tokenize it; prompts over ``max_prompt_length`` are an error or dropped.

    Raises:
        ConfigError: an overlong prompt with ``data.overlong_prompts=error`` (naming the rows), or no
            prompt left.
        DataError: multi-turn chat prompts and a tokenizer without a chat template
            (:func:`~tether.data.check_chat_template`, which also warns once about single-turn ones).
    """
    check_chat_template(
        rows,
        tokenizer,
        apply_chat_template=cfg.apply_chat_template,
        what="MODEL_OR_CHECKPOINT" if what == "DATA" else "actor.model",
    )
    texts, ids, kept, overlong = [], [], [], []
    for row in rows:
        try:
            text = render_prompt(
                row, tokenizer, apply_chat_template=cfg.apply_chat_template, instruction_suffix=cfg.instruction_suffix
            )
            # a chat template already holds the special tokens it wants (no double BOS)
            templated = isinstance(row.prompt, list) and cfg.apply_chat_template and has_chat_template(tokenizer)
            tok = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        except Exception as e:  # noqa: BLE001 - tokenizers raise plain Exceptions (e.g. a character with no token)
            raise ConfigError(
                f"{what}: {row.where} ({str(row.prompt)[:60]!r}) cannot be tokenized by the model's tokenizer: {e}"
            ) from None
        if len(tok) > cfg.max_prompt_length:
            overlong.append((row.where, len(tok)))
            continue
        texts.append(text)
        ids.append(tok)
        kept.append(row)
    if overlong:
        shown = ", ".join(f"{where} ({n} tokens)" for where, n in overlong[:5])
        msg = f"{what}: {len(overlong)} prompt(s) longer than data.max_prompt_length={cfg.max_prompt_length}: {shown}"
        if cfg.overlong_prompts == "error":
            raise ConfigError(msg + " (raise data.max_prompt_length or set data.overlong_prompts=drop)")
        log.warning("%s; dropped", msg)
    if not kept and rows:
        raise ConfigError(f"{what}: no prompt left after dropping overlong ones")
    return PromptSet(kept, texts, ids)


def collate_prompts(ids: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to (B, P) ids and mask."""
    P = max(len(x) for x in ids)
    out = torch.full((len(ids), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), P), dtype=torch.long)
    for i, x in enumerate(ids):
        out[i, P - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, P - len(x) :] = 1
    return out.to(device), mask.to(device)


class PromptSampler:
    """Epoch-wise shuffled batches of prompt indices whose position is two integers (epoch, index).

    The order of epoch e is a permutation drawn from ``numpy.random.default_rng((seed, e))``, so the
    sampler needs no RNG state to resume: ``state_dict() = {"epoch", "index"}`` is exact, also at an
    epoch boundary. A batch never spans two epochs' orders partially: when fewer than ``batch_size``
    prompts remain, the batch takes them and continues with the next epoch's order.
    """

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool = True):
        if n <= 0:
            raise ValueError("PromptSampler needs at least one prompt")
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.epoch, self.index = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng((self.seed, epoch)).permutation(self.n)

    def next_batch(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch_size:
            order = self._order(self.epoch)
            take = min(self.batch_size - len(out), self.n - self.index)
            out.extend(order[self.index : self.index + take].tolist())
            self.index += take
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "n": self.n}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n", self.n) != self.n:
            raise ValueError(f"checkpoint's data position is for {state['n']} prompts, the dataset now has {self.n}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
