"""The error tree of zephon-stream.

```
ZephonError
├── ConfigError                 a setting is invalid or cannot keep a guarantee
├── ConnectorError              an object store refused or failed a request
│   ├── ObjectNotFound          NoSuchKey / NoSuchBucket / missing file
│   ├── AccessDenied            AccessDenied / InvalidAccessKeyId / key escapes the root
│   ├── AlreadyExists           a conditional put lost: the object is there
│   └── Throttled               SlowDown / 503 after every retry
├── DataError                   malformed record or shard: names object and offset
├── CheckpointError             a state cannot be decoded
│   └── IncompatibleState       a state from other data or an incompatible config
└── RefitError
    ├── DigestMismatch
    └── BaseVersionMismatch
```

Every message says what was wrong, the offending value, and what to do.
"""

from __future__ import annotations


class ZephonError(Exception):
    """Base of every error raised by zephon-stream."""


class ConfigError(ZephonError, ValueError):
    """A configuration value is invalid, or the request cannot keep the determinism guarantee."""


class ConnectorError(ZephonError):
    """An object store failed a request."""


class ObjectNotFound(ConnectorError):
    """The object (or bucket) does not exist."""


class AccessDenied(ConnectorError):
    """The store refused access, or a key would escape the store's root."""


class AlreadyExists(ConnectorError):
    """A conditional put found the object already there."""


class Throttled(ConnectorError):
    """The store kept throttling after every retry."""


class DataError(ZephonError):
    """A record or shard is malformed. The message names the object and the offset."""

    def __init__(self, message: str, *, key: str = "", offset: int = -1) -> None:
        super().__init__(message)
        self.key = key
        self.offset = offset


class CheckpointError(ZephonError):
    """A checkpoint cannot be decoded or applied."""


class IncompatibleState(CheckpointError):
    """A checkpoint was written for other data or an incompatible configuration."""


class RefitError(ZephonError):
    """A weight refit cannot proceed."""


class DigestMismatch(RefitError):
    """Bytes did not hash to the digest recorded for them."""


class BaseVersionMismatch(RefitError):
    """A delta was made against a version other than the one held."""


def root_error(exc: BaseException) -> BaseException:
    """The error that matters in a (nested) task-group failure: the first ZephonError, else the only leaf."""
    leaves = list(_leaves(exc))
    ours = [e for e in leaves if isinstance(e, ZephonError)]
    if ours:
        return ours[0]
    return leaves[0] if len(leaves) == 1 else exc


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]
