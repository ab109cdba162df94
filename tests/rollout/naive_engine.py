"""A third rollout engine, for the tests: the registry's contract (``tether.rollout.registry``) met by one small
module, as docs/architecture.md says a new engine is. It samples each request alone, token by token, with a full
forward over the context per step (no KV cache, no padding), from softmax(logits / temperature), and returns each
sampled token's log-prob under that distribution."""

from __future__ import annotations

import torch

from tether.rollout.engine import EngineCapabilities, GenerationResult, check_requests


class NaiveEngine:
    name = "naive"
    capabilities = EngineCapabilities(logprobs=True, stop_strings=False, continues_from_ids=True)

    def __init__(self, model, eos_token_ids):
        self.model, self.eos = model, set(eos_token_ids)

    @torch.no_grad()
    def generate(self, requests, *, seed=None):
        check_requests(self, requests)
        out = []
        for r in requests:
            p = r.params
            if p.top_p != 1.0 or p.top_k:
                raise ValueError("the naive engine samples the full softmax only (top_p 1, top_k 0)")
            context, new, lps, finish = list(r.prompt_ids), [], [], "length"
            device = next(self.model.parameters()).device
            for _ in range(p.max_new_tokens):
                logits = self.model(input_ids=torch.tensor([context + new], device=device)).logits[0, -1].float()
                logp = torch.log_softmax(logits / (p.temperature if p.do_sample else 1.0), -1)
                token = int(torch.multinomial(logp.exp(), 1)) if p.do_sample else int(logp.argmax())
                new.append(token)
                lps.append(float(logp[token]))
                if token in self.eos:
                    finish = "eos"
                    break
            out.append(GenerationResult(new, lps if p.logprobs else None, finish))
        return out

    def sync_weights(self, model):
        self.model = model

    def sleep(self):
        pass

    def wake(self):
        pass

    def close(self):
        pass


def check_usable(model_path, *, key="actor.model", value=None):
    return "the naive engine runs every causal LM"


def build(cfg, *, model, tokenizer, model_path, eos_token_ids):
    return NaiveEngine(model, [tokenizer.eos_token_id, *eos_token_ids])
