"""A lane's operators: read (splits of shards), records (transforms, then the text or chat
payload), tokenize (text, chat, images), feed, mix, shuffle, pack (`Pack` for concat,
`BestFitPack`, `SinglePack`), collate.

The stateful ones (`Feed`, `Mix`, `Shuffle` and the packers) implement
`zephon_stream.engine.operator.Operator`.
"""

__all__: list[str] = []
