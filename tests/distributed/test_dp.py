"""Splitting a batch across data-parallel ranks: by tokens, padded to equal rows, gathered back in order."""

from __future__ import annotations

import torch

from tether.distributed import balanced_partition, gather_rows, split_batch
from tether.distributed.dp import pad_rows, real_rows


def test_balanced_partition_by_tokens():
    # tokens 9, 1, 1, 1, 8 in LPT order 9(0), 8(4), 1(1), 1(2), 1(3): 0 -> r0; 4 -> r1; 1 -> r1 (8 < 9);
    # 2 -> r0 (loads 9 = 9, r0 has fewer rows); 3 -> r1 (9 < 10): loads 10 / 10 (rows 2 / 3, not 3 / 2)
    parts = balanced_partition([9, 1, 1, 1, 8], 2)
    assert parts == [[0, 2], [1, 3, 4]]
    loads = [sum([9, 1, 1, 1, 8][i] for i in p) for p in parts]
    assert loads == [10, 10]
    assert balanced_partition([5], 3) == [[0], [], []]


def test_split_and_gather_restore_order_and_pad():
    from tether.batch import RolloutBatch

    B, T = 5, 3
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0]])
    batch = RolloutBatch(
        prompt_ids=torch.zeros(B, 2, dtype=torch.long),
        prompt_mask=torch.ones(B, 2, dtype=torch.long),
        response_ids=torch.arange(B * T).view(B, T),
        response_mask=mask,
        group_ids=torch.zeros(B, dtype=torch.long),
        rows=list(range(B)),
        prompts=[""] * B,
        responses=[str(i) for i in range(B)],
    )
    shards, parts = split_batch(batch, 2)
    assert [len(s) for s in shards] == [3, 3]  # padded to equal rows, so both ranks run as many forwards
    assert [real_rows(s) for s in shards] == [len(p) for p in parts]
    padded = [s for s in shards if real_rows(s) < len(s)]
    assert padded and int(padded[0].response_mask[real_rows(padded[0]) :].sum()) == 0  # padding never counts
    back = gather_rows([s.response_ids.float() for s in shards], parts)
    assert torch.equal(back, batch.response_ids.float())
    assert "dp_padding" not in batch.extra  # shards have their own extra
    empty = pad_rows(batch, [], 2)
    assert len(empty) == 2 and int(empty.response_mask.sum()) == 0


def _batch(mask):
    from tether.batch import RolloutBatch

    B, T = mask.shape
    return RolloutBatch(
        prompt_ids=torch.zeros(B, 2, dtype=torch.long),
        prompt_mask=torch.ones(B, 2, dtype=torch.long),
        response_ids=torch.zeros(B, T, dtype=torch.long),
        response_mask=mask,
        group_ids=torch.zeros(B, dtype=torch.long),
        rows=list(range(B)),
        prompts=[""] * B,
        responses=[""] * B,
    )


def test_shard_rows_name_each_ranks_real_rows_in_shard_order():
    """DataParallel.shard_rows: where the update's own log-probs of a shard's rows go back in the
    mini-batch (actor.reuse_update_logprobs); the partition of the 5 rows above, padding excluded."""
    from tether.distributed import DataParallel
    from tether.workers.common import LocalDataParallel

    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0]])
    batch = _batch(mask)
    batch.response_ids = torch.arange(15).view(5, 3)
    # tokens 5, 3, 3, 3, 4 (2 prompt + response), LPT: 0 -> r0, 4 -> r1, 1 -> r1 (4 < 5), 2 -> r0 (5 < 7), 3 -> r1 (7 <
    # 8)
    assert [DataParallel(r, 2).shard_rows(batch) for r in (0, 1)] == [[0, 2], [1, 3, 4]]
    for r in (0, 1):
        dp = DataParallel(r, 2)
        shard, rows = dp.shard(batch), dp.shard_rows(batch)
        assert torch.equal(shard.response_ids[: len(rows)], batch.response_ids[rows]) and real_rows(shard) == len(rows)
    assert LocalDataParallel().shard_rows(batch) == [0, 1, 2, 3, 4]


def test_loss_counts_skip_padding_and_reduce_sums(tmp_path):
    """World size 1 (gloo, in this process): padding rows add neither tokens nor sequences; metrics
    are summed over ranks (each rank's value is its share of the global one)."""
    import torch.distributed as dist

    from tether.distributed import DataParallel
    from tether.workers.common import LocalDataParallel

    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    shard = pad_rows(_batch(mask), [0, 1, 2], 5)  # 3 real rows (one without valid tokens) + 2 padding rows
    assert LocalDataParallel().loss_counts(_batch(mask)) == (3.0, 2.0)  # 3 tokens; S = the 2 non-empty rows
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dp = DataParallel(0, 1)
        assert dp.loss_counts(shard) == (3.0, 2.0)  # padding adds nothing
        assert dp.reduce({"a": 1.5}, False) == ({"a": 1.5}, False)
        assert len(dp.shard(_batch(mask))) == 3
        x = torch.tensor([[0.0, -1.5], [-0.25, 0.0]])
        assert torch.equal(dp.merge_rows(x), x) and dp.merge_rows(x) is not x
    finally:
        dist.destroy_process_group()


def test_parallel_dims_checked_in_one_place():
    import pytest

    from tether.distributed import ParallelDims

    ParallelDims(dp_shard=2, world_size=2)
    with pytest.raises(ValueError, match="dp_shard=2 x tp=1 must multiply to the world size 4"):
        ParallelDims(dp_shard=2, world_size=4)


def test_transformer_blocks_of_hf_models():
    from tether.distributed.parallel import transformer_blocks
    from tether.models import ValueModel, load_causal_lm, resolve_model_path

    path = resolve_model_path("embedded")
    lm = load_causal_lm(path)
    blocks = transformer_blocks(lm)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * lm.config.num_hidden_layers
    assert len(transformer_blocks(ValueModel.from_pretrained(path))) == lm.config.num_hidden_layers


def test_ray_keys_in_help_and_validated():
    import pytest

    from tether.config import ConfigError, describe_config, load_config

    text = describe_config()
    for key in (
        "trainer.backend",
        "trainer.n_workers",
        "trainer.ray_address",
        "trainer.nnodes",
        "trainer.n_gpus_per_node",
        "trainer.placement",
        "trainer.fsdp.param_dtype",
        "trainer.fsdp.cpu_offload",
        "trainer.fsdp.activation_checkpointing",
    ):
        assert key in text, key
    assert (
        load_config(
            None, ["trainer.backend=ray", "trainer.n_gpus_per_node=8", "trainer.nnodes=2", "trainer.n_workers=16"]
        ).trainer.n_workers
        == 16
    )
    with pytest.raises(ConfigError, match="trainer.placement"):
        load_config(None, ["trainer.placement=spread"])
    # vLLM replicas as Ray actors
    assert load_config(None, ["trainer.backend=ray", "rollout.engine=vllm"]).rollout.vllm.replicas == 1
