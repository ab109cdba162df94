"""The Ray + FSDP2 backend (``trainer.backend=ray``): placement, sharding and dispatch of the roles.

* :mod:`tether.distributed.parallel`: FSDP2 (and activation checkpointing) as transforms over an
  unchanged Hugging Face model; the parallel degrees checked in one place.
* :mod:`tether.distributed.dp`: a batch split across data-parallel ranks by tokens; the workers'
  data-parallel hooks (global loss normalisers, reduced metrics).
* :mod:`tether.distributed.worker`: one rank's roles, with the dispatch mode of each method.
* :mod:`tether.distributed.ray_backend`: worker groups of Ray actors on placement groups, and the
  driver-side roles the unchanged ``Trainer`` talks to.

Nothing here imports Ray at module level: the local backend never needs it.
"""

from tether.distributed.dp import DataParallel, balanced_partition, gather_rows, split_batch
from tether.distributed.parallel import FSDPSettings, ParallelDims, apply_fsdp, parallelize

__all__ = [
    "DataParallel",
    "FSDPSettings",
    "ParallelDims",
    "apply_fsdp",
    "balanced_partition",
    "gather_rows",
    "parallelize",
    "split_batch",
]
