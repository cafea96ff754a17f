"""Admission at arrival: rate, concurrency and daily quota per tenant."""

from tessera.admission.limits import Admission, AdmissionController, TenantLimits, TokenBucket

__all__ = ["Admission", "AdmissionController", "TenantLimits", "TokenBucket"]
