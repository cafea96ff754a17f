"""Per-model batching: one queue per model, batches bounded by size, units and wait."""

from tessera.batching.batcher import ExecuteBatch, ModelBatcher
from tessera.batching.queue import FifoQueue, QueuePolicyName, RequestQueue, make_queue

__all__ = [
    "ExecuteBatch",
    "FifoQueue",
    "ModelBatcher",
    "QueuePolicyName",
    "RequestQueue",
    "make_queue",
]
