"""The embedded task's exact optimum π*_β as a distillation teacher (``distill.teacher=exact``).

π*_β(y|x) ∝ π_ref(y|x)·exp(r(x,y)/β) is a distribution over whole responses (:func:`tether.tasks.exact.exact_optimum`
over an enumerated :class:`~tether.tasks.exact.ResponseSpace`). A teacher is scored token by token, so it is turned
into its per-token conditionals by the chain rule over the response tree:

    π*(a | x, a_<t) = M(a_<t · a) / M(a_<t),        M(p) = Σ_{y that start with p} π*(y|x)

(:func:`sequence_conditionals`). Their product along any response y of the space is π*(y|x), and at every state
they sum to 1. :class:`ExactTeacher` holds them for a list of prompts and :class:`LookupLM` serves them as a
frozen causal LM (``.logits`` of shape (B, L, V)), so the reference worker's interface (``compute_logprobs``,
``layout_logits``) and every distillation estimator read it unchanged.

The space is every response of at most ``max_new_tokens`` tokens that the student can sample (ended by EOS, or cut
at the limit, as :func:`~tether.tasks.exact.enumerate_policy` lists them), so with ``max_new_tokens`` equal to the
student's ``rollout.max_new_tokens`` every state the student reaches is in the tree and every token it can sample
there has π* > 0 (π_ref > 0 everywhere): KL(π‖π*) is finite. A state outside the tree (deeper than the limit, after
EOS, a prompt the teacher was not built for) has no conditional; :class:`LookupLM` refuses a sequence whose prompt it
does not know.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from tether.tasks import digitsum
from tether.tasks.exact import (
    Optimum,
    ResponseSpace,
    enumerate_policy,
    exact_kl,
    exact_objective,
    exact_optimum,
)


def sequence_conditionals(space: ResponseSpace, logprobs, vocab_size: int) -> dict[tuple[int, ...], np.ndarray]:
    """The per-token conditionals of a distribution over ``space``'s responses.

    Args:
        space: the enumerated responses (``ids``, ``lengths``, ``prompt_ids``).
        logprobs: (N,) log q(y) of each response, aligned with ``space`` (e.g. ``exact_optimum(...).logprobs``).
        vocab_size: V, the width of each conditional.
    Returns:
        {prompt_ids + a_<t: (V,) float64 log q(a | x, a_<t)} for every state of the tree (t < the space's limit, no
        EOS in a_<t); −inf for a token of zero mass.
    Raises:
        ValueError: ``logprobs`` not aligned with ``space``, or a response token outside the vocabulary.
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    if lp.shape != (len(space),):
        raise ValueError(f"logprobs has shape {lp.shape}, the space has {len(space)} responses")
    if int(space.ids.max()) >= vocab_size:
        raise ValueError(f"a response token id {int(space.ids.max())} is outside the vocabulary of {vocab_size}")
    p = np.exp(lp - lp.max())  # unnormalised masses; the conditionals are ratios
    out: dict[tuple[int, ...], np.ndarray] = {}
    head = tuple(space.prompt_ids)
    for d in range(space.max_new_tokens):
        sel = space.lengths > d
        if not sel.any():
            break
        prefixes, tokens, mass = space.ids[sel, :d], space.ids[sel, d], p[sel]
        uniq, inv = np.unique(prefixes, axis=0, return_inverse=True)
        m = np.zeros((len(uniq), vocab_size))
        np.add.at(m, (inv.reshape(-1), tokens), mass)
        with np.errstate(divide="ignore"):
            logc = np.log(m) - np.log(m.sum(axis=1, keepdims=True))
        for row, pre in zip(logc, uniq.tolist(), strict=True):
            out[head + tuple(pre)] = row
    return out


@dataclass(frozen=True, eq=False)
class TeacherPrompt:
    """One prompt's teacher: the reference's space, the reward of each response, and π*_β over them."""

    ref: ResponseSpace
    rewards: np.ndarray
    optimum: Optimum


class ExactTeacher:
    """π*_β of the embedded task for ``prompts``, with its per-token conditionals.

    Args:
        reference: the frozen reference π_ref (a causal LM); tokenizer: its tokenizer.
        prompts: digit-sum prompt texts.
        beta: β > 0 of π*_β ∝ π_ref·exp(r/β).
        max_new_tokens: the response limit T of the space (the student's ``rollout.max_new_tokens``).
        temperature: π_ref's sampling temperature (the student's ``rollout.temperature``).
        reward_fn: r(text, ground_truth, extra_info), the task's reward (ground truth parsed from the prompt).
    Raises:
        ValueError: β <= 0, no prompts, a prompt that is not a digit-sum prompt.
    """

    def __init__(
        self,
        reference,
        tokenizer,
        prompts: Sequence[str],
        beta: float,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        reward_fn: Callable[..., float] = digitsum.compute_score,
    ):
        if not beta > 0:
            raise ValueError(f"the exact teacher needs beta > 0, got {beta!r}")
        if not prompts:
            raise ValueError("the exact teacher needs at least one prompt")
        self.beta = float(beta)
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.prompts: dict[str, TeacherPrompt] = {}
        self.table: dict[tuple[int, ...], np.ndarray] = {}
        vocab = None
        for text in dict.fromkeys(prompts):
            ref = enumerate_policy(reference, tokenizer, text, self.max_new_tokens, self.temperature)
            rewards = ref.rewards(reward_fn)
            opt = exact_optimum(ref.logprobs, rewards, self.beta)
            vocab = vocab or int(ref.ids.max()) + 1
            self.prompts[text] = TeacherPrompt(ref, rewards, opt)
        self.vocab_size = int(getattr(getattr(reference, "config", None), "vocab_size", None) or vocab)
        for tp in self.prompts.values():
            self.table |= sequence_conditionals(tp.ref, tp.optimum.logprobs, self.vocab_size)
        self.prompt_ids = {tp.ref.prompt_ids for tp in self.prompts.values()}

    def model(self) -> LookupLM:
        """The teacher as a frozen causal LM (see :class:`LookupLM`)."""
        return LookupLM(self)

    def evaluate(self, policy, tokenizer, prompts: Sequence[str]) -> dict[str, float]:
        """The student ``policy`` against the teacher, exactly, averaged over ``prompts`` (each one the teacher holds):

        * ``kl_student_teacher``: KL(π‖π*_β) per response, nats (sequence level);
        * ``kl_teacher_student``: KL(π*_β‖π), nats per response;
        * ``teacher_objective``: J_β(π) = E_π[r] − β·KL(π‖π_ref) of the task reward at the teacher's β;
        * ``teacher_objective_gap``: J_β(π*_β) − J_β(π) >= 0, which equals β·KL(π‖π*_β) exactly.

        The student is enumerated over the teacher's space (its T and temperature).
        Raises ValueError for a prompt the teacher was not built for.
        """
        rows = []
        for text in prompts:
            tp = self.prompts.get(text)
            if tp is None:
                raise ValueError(f"the exact teacher was not built for prompt {text!r}")
            pi = enumerate_policy(policy, tokenizer, text, self.max_new_tokens, self.temperature)
            obj = exact_objective(pi.logprobs, tp.ref.logprobs, tp.rewards, self.beta)
            rows.append(
                {
                    "kl_student_teacher": exact_kl(pi.logprobs, tp.optimum.logprobs),
                    "kl_teacher_student": exact_kl(tp.optimum.logprobs, pi.logprobs),
                    "teacher_objective": obj,
                    "teacher_objective_gap": tp.optimum.value - obj,
                }
            )
        return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


class LookupLM(torch.nn.Module):
    """A frozen causal LM whose next-token distribution at each state is the :class:`ExactTeacher`'s conditional.

    ``forward(input_ids, attention_mask=None, position_ids=None)`` returns ``.logits`` (B, L, V) = temperature ·
    log π*(· | s) at each position (so the reference worker's ``log_softmax(logits / temperature)`` is log π*), the
    state s being the sequence's tokens up to that position. A sequence is a row's tokens with attention mask 1 (left
    and right padding), split where ``position_ids`` restart at 0 (packed rows). Positions that are not a state of
    the tree (inside the prompt, padding, past EOS) get logits 0; they score no response token.

    Raises:
        ValueError: a sequence that starts as the teacher's prompts do (their first token) but reaches none of its
            states: a prompt it was not built for, or one tokenized otherwise.
    """

    def __init__(self, teacher: ExactTeacher):
        super().__init__()
        self.teacher = teacher
        # a frozen placeholder: callers find the device as next(model.parameters()).device
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self._starts = {ids[0] for ids in teacher.prompt_ids if ids}

    def forward(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None, **_):
        t = self.teacher
        B, L = input_ids.shape
        ids = input_ids.tolist()
        mask = attention_mask.tolist() if attention_mask is not None else None
        pos = position_ids.tolist() if position_ids is not None else None
        out = np.zeros((B, L, t.vocab_size), dtype=np.float64)
        for b in range(B):
            ctx: list[int] = []
            hit = False
            for j in range(L):
                if mask is not None and not mask[b][j]:
                    continue
                if pos is not None and pos[b][j] == 0 and ctx:  # a packed row: the next sequence starts
                    self._check(ctx, hit)
                    ctx, hit = [], False
                ctx.append(ids[b][j])
                row = t.table.get(tuple(ctx))
                if row is not None:
                    out[b, j] = row
                    hit = True
            if ctx:
                self._check(ctx, hit)
        logits = torch.from_numpy(out * t.temperature).to(dtype=torch.float32, device=input_ids.device)
        return SimpleNamespace(logits=logits)

    def _check(self, ctx: list[int], hit: bool) -> None:
        """A sequence that begins as the teacher's prompts do must reach one of its states."""
        if ctx[0] in self._starts and not hit:
            raise ValueError(
                f"distill.teacher=exact has no state for the sequence {ctx[:12]}: it was built for the run's prompts "
                "as tokenizer(prompt) encodes them"
            )
