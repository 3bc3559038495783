"""The checks, one module per group of rules; importing this package files them all."""

from . import (  # noqa: F401
    async_faults,
    batch_faults,
    bounded,
    close,
    crash,
    data,
    hostile,
    jobs,
    late_writes,
    lookup,
    pins,
    shared,
    stateful,
)
