"""Prefill providers: the protocol every kind implements (``base``) and the three kinds.

    base      PrefillJob, ShareJob, Claim, the Provider protocol, Providers (which one takes a job)
    llama     a second llama-server used only for prefill
    exec      a program started per job
    worker    a long-lived program taking jobs over a socketpair
    seat      a provider several models name: one model's process at a time

The wire contract a vendor implements is docs/protocol.md.
"""

from .base import Claim, Job, JobCounts, PrefillJob, Provider, Providers, ProviderStatistics, ShareJob, parse_claim

__all__ = [
    "Claim",
    "Job",
    "JobCounts",
    "PrefillJob",
    "Provider",
    "ProviderStatistics",
    "Providers",
    "ShareJob",
    "parse_claim",
]
