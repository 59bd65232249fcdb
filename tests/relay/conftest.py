"""Fixtures of the relay tests: "regions" as buckets of the session's SeaweedFS server, each
region but the trainer's reached through its own loopback proxy (a distinct endpoint, as a
region's would be), and helpers that read a prefix the way a watcher would."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from zephon_stream.connectors import open_store
from zephon_stream.connectors.base import Store
from zephon_stream.relay import Prefix
from zephon_stream.testing.proxy import FaultProxy, Link
from zephon_stream.testing.seaweed import SeaweedServer

_ids = itertools.count()


@dataclasses.dataclass
class Region:
    """A bucket on the session server; `options` reach it (through `proxy`, when there is one)."""

    name: str
    bucket: str
    options: dict[str, Any]
    proxy: FaultProxy | None

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def prefix(self, prefix: str = "") -> Prefix:
        return Prefix(self.uri(prefix), **self.options)

    def open(self, prefix: str = "") -> tuple[Store, str]:
        return open_store(self.uri(prefix), **self.options)


@pytest.fixture
def regions(seaweed: SeaweedServer) -> Iterator[Callable[..., Region]]:
    """Factory: `regions("a", link=Link(...))` makes a fresh bucket behind its own proxy;
    `regions("trainer", proxy=False)` one reached directly. All are deleted at teardown."""
    with ExitStack() as stack:
        buckets: list[str] = []

        def make(name: str, *, proxy: bool = True, link: Link | None = None) -> Region:
            bucket = f"zr-{name}-{os.getpid()}-{next(_ids)}"
            seaweed.create_bucket(bucket)
            buckets.append(bucket)
            if not proxy:
                return Region(name, bucket, seaweed.store_options(), None)
            p = stack.enter_context(FaultProxy(seaweed.endpoint_url, link=link))
            return Region(name, bucket, seaweed.store_options(endpoint_url=p.url), p)

        yield make
        for bucket in buckets:
            seaweed.delete_bucket(bucket)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """`zephon relay` sets up the package logger; put it back for the next test."""
    logger = logging.getLogger("zephon_stream")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = saved
