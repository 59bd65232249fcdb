"""A lane's operators: read (splits of shards), tokenize, feed, mix, shuffle, pack, collate.

The stateful ones (`Feed`, `Mix`, `Shuffle`, `Pack`) implement `zephon_stream.engine.operator.Operator`.
"""

__all__: list[str] = []
