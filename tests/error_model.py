"""Error models of the tests that compare two float32 computations of the same thing (issue 35).

Two code paths that compute the same function in another order (world size, micro-batch layout, packing, tensor
parallelism, log-probs reused from the update) agree only up to float32 rounding, and by how much depends on the
CPU's kernels (MKL, oneDNN and ATen pick SSE4.2, AVX2 or AVX-512 code with other blockings). So every such test says
which of these it relies on:

* **by construction**: the same kernels on the same shapes in the same order give the same bits on any CPU (a run
  repeats itself; the actor and the reference at equal weights); compared bitwise.
* **a reduction**: a float32 sum of n terms is off by at most about n·u·Σ|x| (u = 2⁻²⁴); log-probs, losses,
  advantages, ratios and gradient norms are built from O(1) terms, so they are compared at rel = abs =
  :func:`reduction_tol` (n).
* **AdamW**: weights after optimizer steps, element by element against :meth:`AdamTrace.tolerance`.

``make test-kernels`` runs the tests that rely on these (``-m kernels``) under several kernel settings.
"""

from __future__ import annotations

import math

import torch

#: unit roundoff of float32
U = 2.0**-24


def reduction_tol(n: int) -> float:
    """n·u: the relative (and, for O(1) terms, absolute) rounding bound of a float32 reduction over n terms."""
    return n * U


def update_terms(batch, model_config) -> int:
    """The number of terms summed into one gradient element of an update on ``batch``: its token positions (rows ×
    prompt and response width), plus the widest reduction of the model's forward (hidden, MLP or vocabulary size),
    whose rounding every per-token term carries."""
    width = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    inner = max(getattr(model_config, k, 0) or 0 for k in ("hidden_size", "intermediate_size", "vocab_size"))
    return len(batch) * width + inner


def _adam_constants(t: int, beta1: float, beta2: float) -> tuple[float, float]:
    """(c_t, k_t) of AdamW's bias-corrected step m̂_t/(√v̂_t + eps) after t steps:

    with m̂_t = Σ_j a_j g_j and v̂_t = Σ_j b_j g_j², Cauchy-Schwarz gives |m̂_t| ≤ c_t·√v̂_t, c_t = √(Σ_j a_j²/b_j),
    and the step's derivative in any one g_j is at most (a_j + c_t·√b_j)/(√v̂_t + eps), summed over j at most
    k_t/(√v̂_t + eps) with k_t = 1 + c_t·√t (Σ a_j = 1, Σ √b_j ≤ √t). c_1 = 1, k_1 = 2.
    """
    a = [(1 - beta1) * beta1 ** (t - j) / (1 - beta1**t) for j in range(1, t + 1)]
    b = [(1 - beta2) * beta2 ** (t - j) / (1 - beta2**t) for j in range(1, t + 1)]
    c = math.sqrt(sum(x * x / y for x, y in zip(a, b, strict=True)))
    return c, 1.0 + c * math.sqrt(t)


class AdamTrace:
    """Records, after every step of a ``torch.optim.AdamW``, what its error model needs: each parameter's √v̂ (the
    bias-corrected gradient RMS) and the step's lr, t, betas and eps.

    The error model (:meth:`tolerance`): AdamW moves an element by lr·m̂/(√v̂ + eps), at most c_t·lr, so two runs
    whose gradients differ by δg per element differ after the step by at most lr·min(2·c_t, k_t·δg/(√v̂ − δg + eps))
    (:func:`_adam_constants`), plus two ulps of the weight (the decay's product and the step's sum each round, either
    side; the decoupled decay w·(1 − lr·λ) only shrinks an earlier difference). A gradient summed over n terms rounds
    by δg = n·u·G, G the tensor's largest gradient (max √v̂). So an element whose gradient is well above δg agrees to
    ~lr·n·u·G/√v̂, a few hundredths of a step, while one whose gradient is within rounding of zero may take a whole
    ±lr step either way (AdamW normalizes the sign of a rounding-level gradient into a full step: eps = 1e-8 is far
    below it), bounded only by AdamW's own 2·c_t·lr. Over several steps later gradients also see the earlier steps'
    weight differences; over the 3 steps of these tests that is second order (the tests' measured margins show it).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module):
        names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        self.names = {id(p): names[id(p)] for g in optimizer.param_groups for p in g["params"]}
        self.steps: list[dict] = []  # per optimizer step: {name: (√v̂, t, lr, betas, eps)}
        # another optimizer (a test's SGD in AdamW's place) is not traced: tolerance() then refuses
        self.adam = all("betas" in g for g in optimizer.param_groups)
        self._handle = optimizer.register_step_post_hook(self._record) if self.adam else None

    def _record(self, opt, args, kwargs) -> None:
        step = {}  # name: (√v̂, t, lr, betas, eps), for every parameter with AdamW state
        for group in opt.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                st = opt.state.get(p)
                if not st:
                    continue
                t = int(st["step"])
                v = st["exp_avg_sq"].detach()
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
                shat = (v.float() / (1 - beta2**t)).sqrt().cpu()
                step[self.names[id(p)]] = (shat, t, float(group["lr"]), (beta1, beta2), float(group["eps"]))
        self.steps.append(step)

    def close(self) -> AdamTrace:
        """Stop recording (the steps recorded so far stay); returns self."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        return self

    def tolerance(self, weights: dict[str, torch.Tensor], n_terms: int, steps: slice = slice(None)) -> dict:
        """{name: per-element bound on |w − w'|} after ``self.steps[steps]``, for another run of the same steps whose
        gradients differ by float32 rounding of sums of ``n_terms`` terms (class docstring); ``weights``: one run's
        final weights (for the ulp term)."""
        if not self.adam:
            raise TypeError("AdamTrace.tolerance: the traced optimizer is not AdamW")
        recorded = self.steps[steps]
        out = {}
        for name, w in weights.items():
            tol = len(recorded) * 2.0**-22 * w.detach().float().abs().cpu()  # two ulps of the weight per step
            mine = [s[name] for s in recorded if name in s]  # the steps that updated it
            if not mine:
                out[name] = tol
                continue
            dg = n_terms * U * max(float(shat.max()) for shat, *_ in mine)  # n·u·G
            for shat, t, lr, betas, eps in mine:
                c, k = _adam_constants(t, *betas)
                tol = tol + lr * torch.clamp(k * dg / ((shat - dg).clamp(min=0) + eps), max=2 * c)
            out[name] = tol
        return out

    def check(
        self,
        got: dict[str, torch.Tensor],
        want: dict[str, torch.Tensor],
        n_terms: int,
        steps: slice = slice(None),
        what: object = "",
    ) -> float:
        """Assert every element of ``got`` is within :meth:`tolerance` of ``want``; returns the largest
        |got − want|/tolerance (the margin: 1 fails)."""
        assert set(got) == set(want), what
        tols = self.tolerance(want, n_terms, steps)
        worst = 0.0
        for name, w in want.items():
            d = (got[name].detach().float().cpu() - w.detach().float().cpu()).abs()
            ratio = float((d / tols[name]).max())
            assert ratio <= 1.0, (what, name, float(d.max()), ratio)
            worst = max(worst, ratio)
        return worst


def trace_updates(trainer) -> tuple[AdamTrace, list[int]]:
    """A run's error model for comparing its final weights with another run's (:func:`check_final_weights`): its
    actor's AdamW steps, and the terms each update sums (:func:`update_terms`), recorded while it trains."""
    trace, terms = AdamTrace(trainer.roles.actor.optimizer, trainer.roles.actor.model), []
    orig = trainer.roles.actor.update

    def update(batch, *a, **k):
        terms.append(update_terms(batch, trainer.roles.actor.model.config))
        return orig(batch, *a, **k)

    trainer.roles.actor.update = update
    return trace, terms


def check_final_weights(want, got, trace: AdamTrace, terms: list[int]) -> None:
    """The final actor weights of Trainer ``got`` (e.g. the driver's copy of a Ray run's) against traced ``want``'s
    (:func:`trace_updates`): the trainable ones at :class:`AdamTrace`'s per-element bound (AdamW steps whose gradients
    were summed in another order), the frozen ones (LoRA's base) bitwise (never updated)."""
    wl, wr = dict(want.roles.actor.model.named_parameters()), dict(got.roles.actor.model.named_parameters())
    assert set(wl) == set(wr)
    trainable = {k for k, p in wl.items() if p.requires_grad}
    assert all(torch.equal(wl[k], wr[k]) for k in set(wl) - trainable)
    trace.close().check({k: wr[k] for k in trainable}, {k: wl[k] for k in trainable}, max(terms))


def _roles(trainer) -> dict:
    return {r: w for r in ("actor", "critic") if (w := getattr(trainer.roles, r, None)) is not None}


def lockstep(trainers: dict, steps: int) -> tuple[dict, dict, dict]:
    """Train ``steps`` steps of each of ``trainers`` (local Trainers of two code paths), every step from the same
    state: before each step the first trainer's weights, AdamW states and RNG states are copied into the others. So
    every step's comparison is one update from equal inputs, its samples the same bits (the same weights, RNG, kernels
    and shapes generate them), with no RL feedback (samples drawn from weights that already differ) and no AdamW
    accumulation of earlier differences: the one-step error model of :class:`AdamTrace`.

    Returns ``(runs, traces, spans)``: ``runs[name]`` one dict per step, {"metrics", "batch" (the actor update's),
    "actor", "critic" (trainable weights after the step)}; ``traces[role]`` the first trainer's :class:`AdamTrace`;
    ``spans[role][step]`` the slice of its recorded optimizer steps that step took.
    """
    import copy
    import random

    import numpy as np

    first = next(iter(trainers.values()))
    traces = {role: AdamTrace(w.optimizer, w.model) for role, w in _roles(first).items()}
    spans: dict = {role: [] for role in traces}
    runs: dict = {name: [] for name in trainers}
    seen: dict = {}
    for name, t in trainers.items():  # the batch each actor update trains on
        orig = t.roles.actor.update

        def update(batch, *a, _orig=orig, _name=name, **k):
            seen[_name] = copy.deepcopy(batch)
            return _orig(batch, *a, **k)

        t.roles.actor.update = update
    for _ in range(steps):
        rngs = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        state = {
            role: (copy.deepcopy(w.model.state_dict()), copy.deepcopy(w.optimizer_state()))
            for role, w in _roles(first).items()
        }
        begin = {role: len(tr.steps) for role, tr in traces.items()}
        for i, (name, t) in enumerate(trainers.items()):
            if i:
                for role, w in _roles(t).items():
                    w.model.load_state_dict(state[role][0])
                    w.load_optimizer_state(copy.deepcopy(state[role][1]))
            torch.set_rng_state(rngs[0])
            random.setstate(rngs[1])
            np.random.set_state(rngs[2])
            metrics = t.train_step()
            rec = {"metrics": metrics, "batch": seen.pop(name)}
            for role, w in _roles(t).items():
                rec[role] = {n: p.detach().clone() for n, p in w.model.named_parameters() if p.requires_grad}
            runs[name].append(rec)
        for role, tr in traces.items():
            spans[role].append(slice(begin[role], len(tr.steps)))
    for tr in traces.values():
        tr.close()
    return runs, traces, spans
