"""The `zephon` command: `stream`, `inspect` and `config` for the loader, `refit` and `relay` for weights.

Each command's module imports only what it needs, so `zephon relay` never loads torch.
"""

__all__: list[str] = []
