"""The test kit: determinism harness, latency-injecting stores, a fault proxy, the SeaweedFS
launcher, and the save/restore round trip every operator passes (`testing.operators`)."""

__all__: list[str] = []
