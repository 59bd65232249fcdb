"""What a relay node reports: counters and errors (`Tally`), statistics records, Prometheus text.

Every error is counted once, by kind (`digest`, `data`, `not_found`, `connector`, `config`, `refit`;
`child:` before it for a child's, `poll` for a failed poll), and logged once as a JSON event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from zephon_stream.errors import (
    BucketNotFound,
    ConfigError,
    ConnectorError,
    DataError,
    DigestMismatch,
    ObjectNotFound,
    ZephonError,
)

__all__ = ["ChildStatistics", "RelayStatistics", "SyncReport", "Tally", "error_kind", "prometheus_text"]

log = logging.getLogger(__name__)


class ChildStatistics(msgspec.Struct, frozen=True):
    """One child prefix: where it stands and what the relay wrote to it."""

    name: str
    latest: int
    lag_versions: int
    lag_seconds: float
    versions_relayed: int
    objects_written: int
    objects_skipped: int  # already there and verified (a restart, or a racing relay)
    server_side_copies: int
    bytes_written: int
    manifests_raced: int  # MANIFEST already put by a racing relay, with the same bytes
    versions_collected: int
    errors: int
    last_error: str


class RelayStatistics(msgspec.Struct, frozen=True):
    """The relay node: polls, syncs, parent reads, errors by kind, and every child."""

    parent: str
    parent_latest: int
    healthy: bool  # the last sync met no error, and the parent answers polls (none failed or waits 15 s)
    polls: int
    syncs: int
    versions_relayed: int
    objects_read: int
    bytes_read: int
    objects_ahead: int  # copied while their version was still being published (`stream_ahead`)
    errors: dict[str, int]
    last_error: str
    last_success_unix: float
    children: list[ChildStatistics]


@dataclass
class SyncReport:
    """What one `sync()` did: versions committed per child name, and the errors it met."""

    parent_latest: int = 0
    committed: dict[str, list[int]] = field(default_factory=dict)
    errors: list[ZephonError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


class Tally:
    """The node's own counters (children keep theirs), and the one place an error is counted and logged."""

    def __init__(self) -> None:
        self.polls = self.syncs = self.versions = self.objects = self.bytes = self.ahead = 0
        self.errors: dict[str, int] = {}
        self.last_error, self.last_success, self.healthy = "", 0.0, True

    def read(self, nbytes: int) -> None:
        """One object read from the parent."""
        self.objects += 1
        self.bytes += nbytes

    def error(self, kind: str, exc: BaseException, **fields: Any) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.last_error = str(exc)
        log.error("%s", exc, extra={"event": "error", "kind": kind, **fields})


def error_kind(exc: BaseException) -> str:
    return {DigestMismatch: "digest", DataError: "data", ObjectNotFound: "not_found", BucketNotFound: "not_found",
            ConfigError: "config"}.get(
        type(exc), "connector" if isinstance(exc, ConnectorError) else "refit")


_METRICS = [
    ("versions_relayed_total", "counter", "versions committed at a child", "versions_relayed"),
    ("objects_written_total", "counter", "objects written to a child (PUT or copy)", "objects_written"),
    ("objects_skipped_total", "counter", "objects already at a child and verified", "objects_skipped"),
    ("server_side_copies_total", "counter", "objects copied inside one store", "server_side_copies"),
    ("bytes_written_total", "counter", "object bytes uploaded to a child", "bytes_written"),
    ("manifests_raced_total", "counter", "MANIFESTs a racing relay put first", "manifests_raced"),
    ("versions_collected_total", "counter", "versions deleted at a child", "versions_collected"),
    ("child_errors_total", "counter", "errors writing to a child", "errors"),
    ("child_latest_version", "gauge", "newest version committed at a child", "latest"),
    ("lag_versions", "gauge", "versions the child is behind its parent", "lag_versions"),
    ("lag_seconds", "gauge", "seconds since this relay process first saw the oldest version the child still lacks "
     "(a restarted relay counts from its start)", "lag_seconds"),
]


def prometheus_text(s: RelayStatistics) -> str:
    """The statistics in the Prometheus text exposition format (version 0.0.4)."""
    out: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        out.extend([f"# HELP zephon_relay_{name} {doc}", f"# TYPE zephon_relay_{name} {kind}"])
        out.extend(f"zephon_relay_{name}{labels} {_number(value)}" for labels, value in samples)

    parent = f'{{parent="{_label(s.parent)}"}}'
    metric("up", "gauge", "1 when the last sync met no error and the parent answers its polls", [("", int(s.healthy))])
    metric("parent_latest_version", "gauge", "newest version at the parent", [(parent, s.parent_latest)])
    metric("polls_total", "counter", "polls of the parent for a new version", [("", s.polls)])
    metric("syncs_total", "counter", "syncs run", [("", s.syncs)])
    metric("objects_read_total", "counter", "objects read from the parent", [("", s.objects_read)])
    metric("bytes_read_total", "counter", "object bytes read from the parent", [("", s.bytes_read)])
    metric("objects_ahead_total", "counter", "objects copied while their version was being published",
           [("", s.objects_ahead)])
    metric("errors_total", "counter", "errors by kind",
           [(f'{{kind="{_label(k)}"}}', n) for k, n in sorted(s.errors.items())])
    metric("last_success_timestamp_seconds", "gauge", "unix time of the last sync without errors",
           [("", s.last_success_unix)])
    for name, kind, doc, attr in _METRICS:
        metric(name, kind, doc, [(f'{{child="{_label(c.name)}"}}', getattr(c, attr)) for c in s.children])
    return "\n".join(out) + "\n"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
