"""Which tenant's request goes next: weighted fair queueing and latency tiers."""

from tessera.scheduling.fair import FairQueue
from tessera.scheduling.predictor import BatchTimePredictor
from tessera.scheduling.tiers import DEFAULT_TIERS, TierSpec, parse_tiers

__all__ = ["DEFAULT_TIERS", "BatchTimePredictor", "FairQueue", "TierSpec", "parse_tiers"]
