"""The multi-turn runner: environments and tools over the turn loop of :class:`~tether.rollout.runner.RolloutRunner`.

Each turn, every unfinished trajectory's context goes to the engine in one call (many trajectories in flight);
then every environment steps on its model turn at once, in a thread pool (a slow tool does not serialise the batch);
then each observation is rendered and tokenised once, on the calling thread, and appended (``generated_mask`` 0).
A trajectory ends when its environment says ``done``, at ``agent.max_turns``, or when a model turn does not end
with an end-of-turn id (cut by ``rollout.max_new_tokens``: there is no assistant turn to answer). After the last
turn each trajectory's turn contexts are checked against the chat template (:mod:`tether.agents.templates`).

Per trajectory: ``turn_rewards`` (the environment's per-turn rewards, 0.0 where none) and ``turn_ends`` (each
turn's last model token in ``response_ids``), the interface of the per-turn returns in ``tether.algos``.
Metrics of the last :meth:`AgentRunner.run`: :attr:`AgentRunner.metrics`.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tether.agents import (
    AgentSpec,
    ObservationRenderer,
    StepResult,
    ToolEnvironment,
    check_turn_contexts,
    environment_kwargs,
    mismatch_message,
    resolve_format,
)
from tether.batch import RolloutBatch
from tether.rollout.runner import RolloutRunner, Trajectory

__all__ = ["AGENT_TOTALS", "MAX_STEP_THREADS", "AgentRunner", "Episode", "agent_metrics", "sum_totals"]

log = logging.getLogger("tether")

#: The most environment steps run at once (threads); a batch larger than this steps in waves.
MAX_STEP_THREADS = 64


@dataclass
class Episode:
    """One trajectory's environment and conversation.

    Attributes:
        env: the environment; messages: the conversation so far as chat messages (the prompt's, then the model's
        turns as decoded text and the observations as rendered); starts: per model turn, where it starts in
        ``response_ids`` (its context is the prompt and what precedes); expected: per model turn, the chat
        template's ids for the conversation then (None without a chat template);
        turn_start: where the current model turn starts in ``response_ids``; events: counters;
        pieces: under ``agent.on_prefix_mismatch=split``, the trajectory's closed pieces in order (each a
        :class:`Trajectory` ending with a model turn; the trajectory object itself is the last piece);
        bridges: per closed piece, the observation ids that followed it (what the trajectory, unsplit, would have
        appended: the next piece's prompt holds them as the template renders them).
    """

    env: Any
    messages: list[dict] | None
    starts: list[int] = field(default_factory=list)
    expected: list[list[int]] | None = field(default_factory=list)
    turn_start: int = 0
    events: dict[str, int] = field(default_factory=dict)
    pieces: list[Trajectory] = field(default_factory=list)
    bridges: list[list[int]] = field(default_factory=list)


class AgentRunner(RolloutRunner):
    """A :class:`RolloutRunner` whose trajectories run an environment for up to ``agent.max_turns`` model turns.

    Args:
        agent: the loaded ``agent`` section (:func:`tether.agents.build_agent`); the rest as
            :class:`RolloutRunner` (online only).

    An environment whose ``reset``/``step`` raises (or that cannot be made) fails its trajectory alone: it takes no
    more turns, :meth:`collate` drops it (``response_mask`` 0) and ``agent/env_errors`` counts it; one warning per
    rollout names the first (sample, turn, exception). The run goes on.

    Raises:
        ValueError: (from :meth:`run`, before any turn) with ``agent.environments``, a row that names an unknown
            environment, or none without ``agent.environment`` (:func:`tether.agents.row_environment`).
        ValueError: (from :meth:`run`) with ``agent.on_prefix_mismatch=error``, the first trajectory whose turn
            context is not the template's (one line: sample, turn, token id and text).
    """

    def __init__(self, engine, tokenizer, device, *, params, agent: AgentSpec, eos_token_ids=None):
        super().__init__(engine, tokenizer, device, params=params, mode="online", eos_token_ids=eos_token_ids)
        self.agent = agent
        template = getattr(tokenizer, "chat_template", None)
        self.templated = bool(template)
        self.fmt = resolve_format(agent.tool_format, template)
        self.schemas = [t.schema for t in agent.tools] or None
        eos_texts = [tokenizer.convert_ids_to_tokens(i) for i in self.eos_token_ids]
        self.render = ObservationRenderer(
            tokenizer, tools=self.schemas, eos_texts=eos_texts, max_tokens=agent.max_observation_tokens
        )
        self.episodes: list[Episode] = []
        self.last_trajectories: list[Trajectory] = []
        self.metrics: dict[str, float] = {}
        self.totals: dict[str, float] = {}

    def fork(self, engine) -> AgentRunner:
        """:meth:`RolloutRunner.fork`; the observation renderer uses the copy's tokenizer too."""
        other = super().fork(engine)
        other.render = copy.copy(self.render)
        other.render.tok = other.tok
        other.episodes, other.last_trajectories, other.metrics, other.totals = [], [], {}, {}
        return other

    # -- the conversation as the template renders it -------------------------------------------------------------

    def _template_ids(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, tools=self.schemas, add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _make_env(self, row, j: int):
        extra = getattr(row, "extra_info", None) or {}
        factory = self.agent.factory(row, j)  # agent.environments: the row's extra_info.environment picks one
        if factory is not None:
            return factory(**environment_kwargs(row))
        return ToolEnvironment(
            self.agent.tools, fmt=self.fmt, timeout_s=self.agent.tool_timeout_s, tools_kwargs=extra.get("tools_kwargs")
        )

    def begin(self, trajectories: list[Trajectory], rows: list | None) -> None:
        """One environment per trajectory, reset on its row. A chat prompt (a list of messages) with a chat template
        is rendered again here with the tools' schemas and the first observation (``reset``'s, as a ``user``
        message); other prompts keep their ids (a first observation is then refused)."""
        rows = rows if rows is not None else [None] * len(trajectories)
        self.episodes = []
        for j, row in enumerate(rows):  # a row naming an unknown environment: refused, not dropped (a data error)
            self.agent.factory(row, j)
        stages = ["constructor"] * len(rows)

        def start(j: int):
            env = self._make_env(rows[j], j)
            stages[j] = "turn 0 (reset)"
            return env, env.reset(rows[j])

        timeout = None if self.agent.environment is None and not self.agent.environments else self.agent.step_timeout_s
        started = _bounded(start, len(rows), timeout, "the constructor and reset")
        for j, (t, row, r) in enumerate(zip(trajectories, rows, started, strict=True)):
            prompt = getattr(row, "prompt", None)
            chat = isinstance(prompt, list) and self.templated
            if not isinstance(r, Exception) and r[1] is not None and not chat:
                r = ValueError(
                    "reset gave a first observation, but the prompt is not a list of chat messages rendered by a "
                    "chat template; return None from reset, or use chat prompts"
                )
            if isinstance(r, Exception):  # the sample is dropped and counted (agent/env_errors)
                t.error = f"sample {j}, {stages[j]}: {type(r).__name__}: {r}"
                self.episodes.append(Episode(None, None, expected=None))
                continue
            env, first = r
            messages = [dict(m) for m in prompt] if chat else None
            if first is not None:
                try:
                    messages += self.render.truncate(_as_messages(first))
                except Exception as err:  # noqa: BLE001 - a first observation that is not text or messages
                    t.error = f"sample {j}, turn 0 (reset): bad observation: {type(err).__name__}: {err}"
                    self.episodes.append(Episode(None, None, expected=None))
                    continue
            if chat:
                t.prompt_ids = self._template_ids(messages)
            self.episodes.append(Episode(env, messages, expected=[] if chat else None))
        self._by_id = {id(t): e for t, e in zip(trajectories, self.episodes, strict=True)}
        for t, e in zip(trajectories, self.episodes, strict=True):
            if t.error is None:
                self._record_turn(e, 0)

    def _record_turn(self, e: Episode, start: int) -> None:
        """The next model turn starts at ``start`` in ``response_ids``; the template's ids for it, now."""
        e.starts.append(start)
        e.turn_start = start
        if e.expected is not None:
            e.expected.append(self._template_ids(e.messages))

    def next_turns(self, trajectories: list[Trajectory]) -> list[list[int] | None]:
        """Step every environment on its model turn at once (threads), then render and append observations."""
        episodes = [self._by_id[id(t)] for t in trajectories]
        ended = [t.finish_reason != "eos" for t in trajectories]
        turns = [
            self.tok.decode(t.response_ids[e.turn_start :], skip_special_tokens=True)
            for t, e in zip(trajectories, episodes, strict=True)
        ]

        def step(k: int) -> StepResult | Exception:
            if ended[k]:
                return StepResult(None, None, True)
            try:
                r = episodes[k].env.step(turns[k])
            except Exception as err:  # noqa: BLE001 - reported below with the sample
                return err
            if not isinstance(r, StepResult):
                return TypeError(f"step returned {type(r).__name__}, not a StepResult")
            return r

        user_env = self.agent.environment is not None or bool(self.agent.environments)
        # a hung step is abandoned at agent.step_timeout_s (its daemon thread is never waited on); a tool set's
        # calls are bounded one by one (agent.tool_timeout_s)
        results = _bounded(step, len(trajectories), self.agent.step_timeout_s if user_env else None, "step")
        out: list[list[int] | None] = []
        for t, e, r in zip(trajectories, episodes, results, strict=True):
            reward = 0.0 if isinstance(r, Exception) or r.reward is None else _finite(r.reward)
            if isinstance(reward, Exception):
                r = reward
            if isinstance(r, Exception):  # the sample is dropped and counted (agent/env_errors), the run goes on
                t.error = f"sample {self.episodes.index(e)}, turn {t.turns}: {type(r).__name__}: {r}"
                out.append(None)
                continue
            t.turn_rewards.append(reward)
            for name, n in r.events.items():
                e.events[name] = e.events.get(name, 0) + int(n)
            if r.done or t.turns >= self.agent.max_turns:
                out.append(None)
                continue
            try:
                ids, shown = self.render(_as_messages(r.observation))
            except Exception as err:  # noqa: BLE001 - an observation that is not text or messages: the env's bug
                j = self.episodes.index(e)
                t.error = f"sample {j}, turn {t.turns}: bad observation: {type(err).__name__}: {err}"
                out.append(None)
                continue
            if e.messages is not None:
                end = t.response_ids[e.turn_start :]
                if end and end[-1] in self.eos_token_ids:
                    end = end[:-1]
                e.messages.append({"role": "assistant", "content": self.tok.decode(end, skip_special_tokens=False)})
                e.messages += shown
            self._record_turn(e, len(t.response_ids) + len(ids))
            if self.agent.on_prefix_mismatch == "split" and e.expected is not None:
                want = e.expected[-1]
                if [*t.context, *ids] != want:  # the next turn is generated from the rendering, as a new piece
                    e.pieces.append(_split(t, want))
                    e.bridges.append(list(ids))
                    e.starts, e.expected, e.turn_start = [0], [want], 0
                    out.append([])
                    continue
            out.append(ids)
        return out

    def end(self, trajectories: list[Trajectory]) -> None:
        """The prefix check of every trajectory that did not fail, then :attr:`metrics`; the first failed
        environment is warned about (once per rollout, naming the sample, turn and exception)."""
        mismatches = 0
        for j, (t, e) in enumerate(zip(trajectories, self.episodes, strict=True)):
            if e.expected is None or t.error is not None:
                continue
            contexts = [[*t.prompt_ids, *t.response_ids[:s]] for s in e.starts]
            m = check_turn_contexts(contexts, e.expected)
            if m is not None:
                mismatches += 1
                if self.agent.on_prefix_mismatch == "error":
                    raise ValueError(mismatch_message(j, m, self.tok))
        failed = [t.error for t in trajectories if t.error is not None]
        if failed:
            log.warning(
                "agent environment failed on %d of %d trajectories, dropped (agent/env_errors); first: %s",
                len(failed),
                len(trajectories),
                failed[0],
            )
        self.last_trajectories = trajectories
        self.totals = {
            "trajectories": float(len(trajectories)),
            "turns": float(sum(t.turns for t in trajectories)),
            "tool_calls": float(sum(e.events.get("tool_calls", 0) for e in self.episodes)),
            "tool_errors": float(sum(e.events.get("tool_errors", 0) for e in self.episodes)),
            "observation_tokens": float(sum(len(t.generated_mask) - sum(t.generated_mask) for t in trajectories)),
            "response_tokens": float(sum(len(t.response_ids) for t in trajectories)),
            "prefix_mismatch": float(mismatches + sum(bool(e.pieces) for e in self.episodes)),
            "env_errors": float(len(failed)),
            "prefix_splits": float(sum(len(e.pieces) for e in self.episodes)),
        }
        self.metrics = agent_metrics(self.totals)

    def collate(self, prompts, rep, trajectories, group_ids) -> RolloutBatch:
        """:meth:`RolloutRunner.collate`, with the multi-turn parts: ``turn_rewards`` (B, T), each turn's reward at
        its last model token (``Trajectory.turn_ends``); a trajectory whose environment failed dropped (its
        ``response_mask`` 0, ``extra["agent_failed"]`` (B,) bool); ``extra["agent_totals"]`` (the counts behind
        :attr:`metrics`, which :func:`agent_metrics` turns into ``agent/*``); ``extra["agent_counts"]`` (B, 3) long:
        each trajectory's model turns, tool calls and tool errors (the per-sample records of ``tether eval``);
        ``extra["agent_lengths"]`` (B,) long: each trajectory's response tokens, a dropped one's too (a checkpoint's
        pending batch keeps them, :meth:`saved_extra`).

        Under ``agent.on_prefix_mismatch=split`` a row is a piece (B = pieces, each trajectory's in order): its own
        prompt ids (the first piece's the trajectory's, a later one's the template's rendering it was generated
        from) and response; ``group_ids``, ``rows`` and ``prompts`` its trajectory's; its turns' rewards at their
        last model tokens; ``agent_counts`` on the trajectory's last piece (0 on the others); a failed trajectory's
        pieces all dropped; ``extra["agent_trajectory"]`` (B,) long: each row's trajectory (index into
        ``trajectories``), and ``extra["agent_joined"]``: the batch of the trajectories whole (a row each, as
        :meth:`collate` builds it unsplit: each piece's response and the observations between them, the first
        piece's prompt), which the trainer scores and ``tether eval`` counts; both set only when some trajectory
        split."""
        pieces = [[*e.pieces, t] for t, e in zip(trajectories, self.episodes, strict=True)]
        batch = self._collate_pieces(prompts, rep, trajectories, group_ids, pieces)
        if len(batch) > len(trajectories):
            joined = [[_join(e, t)] for t, e in zip(trajectories, self.episodes, strict=True)]
            batch.extra["agent_joined"] = self._collate_pieces(prompts, rep, trajectories, group_ids, joined)
        return batch

    def _collate_pieces(self, prompts, rep, trajectories, group_ids, pieces: list[list[Trajectory]]) -> RolloutBatch:
        """:meth:`collate` with ``pieces[j]`` the rows of trajectory j."""
        of = [j for j, p in enumerate(pieces) for _ in p]  # each row's trajectory
        rows = [x for p in pieces for x in p]
        if len(rows) > len(trajectories):  # agent.on_prefix_mismatch=split: a row per piece
            index = torch.as_tensor(of, device=group_ids.device)
            batch = super().collate(prompts, [rep[j] for j in of], rows, group_ids[index])
        else:
            batch = super().collate(prompts, rep, rows, group_ids)
        rewards = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        for i, t in enumerate(rows):
            for end, r in zip(t.turn_ends, t.turn_rewards, strict=False):
                if end >= 0 and r:
                    rewards[i, end] = float(r)
        batch.turn_rewards = rewards.to(batch.response_mask.device)
        last = [i + 1 == len(of) or of[i + 1] != j for i, j in enumerate(of)]  # a trajectory's last piece
        counts = [
            [
                trajectories[j].turns,
                self.episodes[j].events.get("tool_calls", 0),
                self.episodes[j].events.get("tool_errors", 0),
            ]
            if is_last
            else [0, 0, 0]
            for j, is_last in zip(of, last, strict=True)
        ]
        saved = {
            "agent_failed": torch.tensor([trajectories[j].error is not None for j in of], dtype=torch.bool),
            "agent_counts": torch.tensor(counts, dtype=torch.long),
            "agent_totals": dict(self.totals),
        }
        batch = self._agent_parts(batch, saved)
        if len(rows) > len(trajectories):
            batch.extra["agent_trajectory"] = torch.as_tensor(of, dtype=torch.long)
        return batch

    def _agent_parts(self, batch: RolloutBatch, saved: dict) -> RolloutBatch:
        """The failed trajectories dropped, and the ``agent_*`` extras of :meth:`collate`."""
        failed = saved["agent_failed"].to(device=batch.response_mask.device, dtype=torch.bool)
        batch.extra["agent_lengths"] = batch.response_mask.sum(-1).long()
        batch.drop(failed)
        batch.extra["agent_failed"] = failed
        batch.extra["agent_totals"] = dict(saved["agent_totals"])
        batch.extra["agent_counts"] = saved["agent_counts"].long().cpu()
        return batch

    def saved_extra(self, batch: RolloutBatch) -> tuple[dict[str, torch.Tensor], dict]:
        """The ``agent_*`` extras of a pending batch, for :meth:`restore`: the failed rows, per-trajectory counts and
        lengths (tensors) and the rollout's totals behind ``agent/*`` (JSON); the per-turn rewards and the
        observation mask are batch tensors (``turn_rewards``, ``generated_mask``)."""
        x = batch.extra
        if "agent_failed" not in x:
            return {}, {}
        tensors = {k: x[k] for k in ("agent_failed", "agent_counts", "agent_lengths")}
        return tensors, {"agent_totals": x["agent_totals"]}

    def collate_restored(self, prompts, rep, trajectories, group_ids, saved: dict) -> RolloutBatch:
        """A pending batch rebuilt (:meth:`RolloutRunner.restore`, its rows at their saved ``agent_lengths``, the
        dropped ones' too): the single-turn batch, then the saved ``agent_*`` parts; its ``turn_rewards`` are the
        caller's to set (saved as a batch tensor)."""
        batch = super().collate(prompts, rep, trajectories, group_ids)
        if "agent_failed" not in saved:  # a checkpoint of a single-turn run: nothing to add
            return batch
        return self._agent_parts(batch, saved)


AGENT_TOTALS = (
    "trajectories",
    "turns",
    "tool_calls",
    "tool_errors",
    "observation_tokens",
    "response_tokens",
    "prefix_mismatch",
    "env_errors",
    "prefix_splits",
)
"""The counts of a rollout behind ``agent/*``: summed over rollouts (validation's batches), then
:func:`agent_metrics`."""


def agent_metrics(totals: dict[str, float]) -> dict[str, float]:
    """``agent/*`` of one or more rollouts' summed :data:`AGENT_TOTALS`: ``turns_mean`` (model turns per trajectory),
    ``tool_calls``, ``tool_errors``, ``prefix_mismatch`` (trajectories; under ``split``, those split), ``env_errors``
    (trajectories dropped because their environment's ``reset``/``step`` raised), ``prefix_splits`` (new pieces
    started at a mismatch, ``agent.on_prefix_mismatch=split``; a checkpoint's totals without it: 0): counts;
    ``observation_frac``: observation tokens / all response tokens."""
    if not totals:
        return {}
    n, tokens = max(1.0, totals["trajectories"]), totals["response_tokens"]
    return {
        "agent/turns_mean": totals["turns"] / n,
        "agent/tool_calls": totals["tool_calls"],
        "agent/tool_errors": totals["tool_errors"],
        "agent/observation_frac": totals["observation_tokens"] / tokens if tokens else 0.0,
        "agent/prefix_mismatch": totals["prefix_mismatch"],
        "agent/env_errors": totals["env_errors"],
        "agent/prefix_splits": totals.get("prefix_splits", 0.0),
    }


def sum_totals(parts: list[dict[str, float]]) -> dict[str, float]:
    """The sum of rollouts' :data:`AGENT_TOTALS` (empty ones, of single-turn rollouts, left out)."""
    parts = [p for p in parts if p]
    return {k: sum(p.get(k, 0.0) for p in parts) for k in AGENT_TOTALS} if parts else {}


def _split(t: Trajectory, prompt_ids: list[int]) -> Trajectory:
    """Close ``t``'s current piece (returned: everything up to its last model turn, the observation after it left
    out) and start ``t`` again as a new piece with prompt ``prompt_ids`` (the template's rendering) and nothing
    after it; ``t.turns`` keeps counting the trajectory's model turns (``agent.max_turns``)."""
    piece = copy.copy(t)
    piece.turns = len(t.turn_ends)
    piece.finish_reason = "eos"  # it goes on after its last turn, which ended with an end-of-turn id
    t.prompt_ids = list(prompt_ids)
    t.response_ids, t.generated_mask, t.turn_ends, t.turn_rewards = [], [], [], []
    t.logprobs = None if t.logprobs is None else []
    return piece


def _join(e: Episode, t: Trajectory) -> Trajectory:
    """The trajectory whole: its pieces' responses in order with the observation ids between them
    (``generated_mask`` 0, log-prob 0.0), after the first piece's prompt; ``t`` itself when it did not split."""
    if not e.pieces:
        return t
    whole = copy.copy(e.pieces[0])
    whole.response_ids, whole.generated_mask = [], []
    whole.turn_ends, whole.turn_rewards = [], []
    with_lp = any(p.logprobs is not None for p in (*e.pieces, t))
    whole.logprobs = [] if with_lp else None
    for p, bridge in zip([*e.pieces, t], [*e.bridges, []], strict=True):
        at = len(whole.response_ids)
        whole.turn_ends += [end + at if end >= 0 else end for end in p.turn_ends]
        whole.turn_rewards += p.turn_rewards
        whole.response_ids += [*p.response_ids, *bridge]
        whole.generated_mask += [*p.generated_mask, *[0] * len(bridge)]
        if with_lp:
            lp = p.logprobs if p.logprobs is not None else [math.nan] * len(p.response_ids)
            whole.logprobs += [*lp, *[0.0] * len(bridge)]
    whole.turns, whole.finish_reason, whole.error = t.turns, t.finish_reason, t.error
    return whole


def _finite(reward) -> float | Exception:
    try:
        x = float(reward)
    except (TypeError, ValueError) as err:
        return TypeError(f"step gave the reward {reward!r}, not a number ({err})")
    return x if math.isfinite(x) else ValueError(f"step gave the reward {x}, not a finite number")


def _bounded(fn, n: int, timeout_s: float | None, what: str) -> list:
    """``fn(k)`` for ``k < n`` at once, each in a daemon thread (waves of :data:`MAX_STEP_THREADS`): per ``k`` its
    result, or the exception it raised, or a :class:`TimeoutError` when it ran past ``timeout_s`` seconds (None: no
    limit). A thread past its time is abandoned, never joined again: the run goes on and the process can exit."""
    out: list = [None] * n

    def run(k: int) -> None:
        try:
            out[k] = fn(k)
        except Exception as err:  # noqa: BLE001 - reported by the caller with the sample
            out[k] = err

    for lo in range(0, n, MAX_STEP_THREADS):
        threads = {
            k: threading.Thread(target=run, args=(k,), daemon=True, name=f"tether-env-{k}")
            for k in range(lo, min(n, lo + MAX_STEP_THREADS))
        }
        for th in threads.values():
            th.start()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for k, th in threads.items():
            th.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if th.is_alive():
                out[k] = TimeoutError(f"{what} did not return within {timeout_s:g} s (agent.step_timeout_s); abandoned")
    return out


#: The roles an observation message may have (docs/agents.md).
OBSERVATION_ROLES = ("tool", "user")


def _as_messages(observation) -> list[dict]:
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        raise TypeError("the observation is one message, not a list of messages; return [message]")
    messages = [dict(m) for m in observation]
    for i, m in enumerate(messages):
        if m.get("role") not in OBSERVATION_ROLES:
            raise ValueError(
                f"observation message {i} has the role {m.get('role')!r}; an environment's messages are 'tool' or "
                "'user'"
            )
    return messages
