"""Throughput metrics of a step: ``perf/mfu`` against a measured matmul ceiling, tokens per second.

``perf/mfu`` follows verl's and nanoGPT's convention: the achieved FLOP/s of the actor update
(forward + backward ≈ 6 FLOPs per parameter per token, Kaplan et al. 2020) divided by a peak. Here
the peak is *measured*, not a datasheet number: the best of a few (n × n) @ (n × n) matmuls in the
update's compute dtype on the update's device and thread count (n = 1024 on CPU, 4096 on a GPU), so
an MFU of 1 means "as fast as one large matmul on this machine". Attention's score/value products
(O(T²) per sequence) are left out of the count, as are the embedding lookup and element-wise ops.
"""

from __future__ import annotations

import time

import torch


def matmul_ceiling_flops(
    device: torch.device, dtype: torch.dtype = torch.float32, *, n: int | None = None, repeats: int = 5
) -> float:
    """The best FLOP/s of ``repeats`` (n × n) @ (n × n) matmuls (2·n³ FLOPs each) on ``device`` in ``dtype``.

    The operands come from a private generator, so no global RNG state (sampling, dropout) changes.
    """
    n = n or (1024 if device.type == "cpu" else 4096)
    gen = torch.Generator().manual_seed(0)  # a private generator: measuring never moves the run's RNG streams
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / max(best, 1e-12)


def matmul_params(model: torch.nn.Module) -> tuple[int, int]:
    """(body, head) parameters that enter matmuls: every parameter but the input embedding, and the
    LM head's (V × H) weight (counted once even when tied to the input embedding)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    body = total - emb.numel() - (0 if head is emb else head.numel())
    return body, head.numel()


def update_flops(body_params: int, head_params: int, context_tokens: float, response_tokens: float) -> float:
    """FLOPs of one forward + backward: 6·N_body per token of context (the tokens fed: prompt + response
    but each response's last token, which is only scored) and 6·N_head per response token (the LM head
    runs on the positions that score one only)."""
    return 6.0 * (body_params * context_tokens + head_params * response_tokens)
