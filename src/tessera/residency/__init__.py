"""The memory budget of a device, in measured bytes: load, evict, pin, reserve."""

from tessera.residency.activation import ActivationBook, ActivationStats
from tessera.residency.host import ModelHost
from tessera.residency.manager import Lease, ResidencyManager
from tessera.residency.patience import PATIENCE_SHARE
from tessera.residency.plan import BatchPart, items_peak_units, peak_units, split_to_fit
from tessera.residency.policy import EvictionPolicy, EvictionPolicyName, make_eviction_policy
from tessera.residency.stats import ModelResidency, ResidencyStats
from tessera.residency.table import ModelEntry, ModelState, Reservation, ResidencyTable
from tessera.residency.transfer import MAX_HOST_LOADS

__all__ = [
    "MAX_HOST_LOADS",
    "PATIENCE_SHARE",
    "ActivationBook",
    "ActivationStats",
    "BatchPart",
    "EvictionPolicy",
    "EvictionPolicyName",
    "Lease",
    "ModelEntry",
    "ModelHost",
    "ModelResidency",
    "ModelState",
    "Reservation",
    "ResidencyManager",
    "ResidencyStats",
    "ResidencyTable",
    "items_peak_units",
    "make_eviction_policy",
    "peak_units",
    "split_to_fit",
]
