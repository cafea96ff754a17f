"""Admission at arrival: rate, concurrency and daily quota per tenant."""

from tessera.admission.limits import (
    Admission,
    AdmissionControl,
    AdmissionController,
    TenantLimits,
    TokenBucket,
)

__all__ = ["Admission", "AdmissionControl", "AdmissionController", "TenantLimits", "TokenBucket"]
