"""The deterministic loader: config, plan, lanes of operators, backends, the sequencer and checkpoints.

Its public names are exported from `zephon_stream` (`Loader`, `Config`, `SourceConfig`, ...).
"""

__all__: list[str] = []
