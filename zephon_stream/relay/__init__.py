"""The relay: copy refit versions from a parent prefix down to child prefixes (a tree of regions).

    async with Relay("s3://trainer/policy/", [Prefix("s3://eu/policy/", endpoint_url=...)]) as relay:
        await relay.run(stop)            # or: report = await relay.sync()

It imports no torch: a relay node moves bytes and checks digests, it never holds a tensor.
"""

from __future__ import annotations

from zephon_stream.relay.metrics import ChildStatistics, RelayStatistics, SyncReport, prometheus_text
from zephon_stream.relay.node import Relay
from zephon_stream.relay.prefix import Prefix

__all__ = ["ChildStatistics", "Prefix", "Relay", "RelayStatistics", "SyncReport", "prometheus_text"]
