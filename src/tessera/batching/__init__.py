"""Per-model batching: one queue per model, batches bounded by size, units and wait."""

from tessera.batching.batcher import ModelBatcher
from tessera.batching.queue import FifoQueue, QueuePolicyName, RequestQueue, make_queue

__all__ = [
    "FifoQueue",
    "ModelBatcher",
    "QueuePolicyName",
    "RequestQueue",
    "make_queue",
]
