"""Shared fixtures: real S3-compatible servers on 127.0.0.1, a fresh bucket per test, fault proxies.

    def test_x(s3):                     # SeaweedFS (`weed mini`), one server per session
        store, prefix = open_store(s3.uri, **s3.options)
    def test_y(moto_s3): ...            # moto's ThreadedMotoServer: fast, no real signing
    def test_z(any_s3): ...             # the same test against both
    def test_w(s3, s3_proxy):           # a FaultProxy in front of SeaweedFS
        proxy, options = s3_proxy(faults=Faults(slowdown=0.1))

Each `*_s3` fixture is an `S3Target`: `.bucket` (created for the test, emptied and deleted
after), `.uri` (`s3://bucket/`), `.options` (the keyword options of `S3Store`/`open_store`:
endpoint, region, path-style addressing, credentials), `.kind` ("seaweed" or "moto") and
`.client()` (a synchronous botocore client for setup and checks, closed at teardown).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from typing import Any

import botocore.session
import hypothesis
import pytest
from botocore.config import Config

from tests._offload import Offload
from zephon_stream.testing.proxy import FaultProxy, Faults, Link
from zephon_stream.testing.seaweed import SeaweedServer, empty_bucket

# Property tests draw the same examples on every run (`derandomize`: seeded from each test's
# code), so `make test` and CI give the same verdict on the same code; `make fuzz` (the "fuzz"
# profile) draws new ones each run and prints a failure's example and its @reproduce_failure blob.
hypothesis.settings.register_profile("test", derandomize=True)
hypothesis.settings.register_profile("fuzz", derandomize=False, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "test"))

_bucket_ids = itertools.count()


@dataclasses.dataclass
class S3Target:
    kind: str
    bucket: str
    options: dict[str, Any]
    client_factory: Callable[[], Any]
    _client: Any = None

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/"

    def client(self) -> Any:
        """A synchronous botocore client on the same server, for setup and checks; closed at teardown."""
        if self._client is None:
            self._client = self.client_factory()
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _bucket_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_bucket_ids)}"


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    """One SeaweedFS `weed mini` server for the whole session, on free loopback ports."""
    with SeaweedServer() as server:
        yield server


@pytest.fixture
def s3(seaweed: SeaweedServer) -> Iterator[S3Target]:
    """A fresh, empty bucket on the session's SeaweedFS server."""
    bucket = _bucket_name("zt")
    seaweed.create_bucket(bucket)
    target = S3Target("seaweed", bucket, seaweed.store_options(), seaweed.client)
    yield target
    target.close()
    seaweed.delete_bucket(bucket)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto's S3 in a server thread on 127.0.0.1 (a free port); yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _moto_client(endpoint: str) -> Any:
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="moto-test-key",
        aws_secret_access_key="moto-test-secret", config=Config(s3={"addressing_style": "path"}))


@pytest.fixture(scope="session")
def _moto_admin(moto_endpoint: str) -> Iterator[Any]:
    with closing(_moto_client(moto_endpoint)) as client:
        yield client


@pytest.fixture
def moto_s3(moto_endpoint: str, _moto_admin: Any) -> Iterator[S3Target]:
    """A fresh, empty bucket on the session's moto server."""
    options = {"endpoint_url": moto_endpoint, "region": "us-east-1", "addressing_style": "path",
               "access_key_id": "moto-test-key", "secret_access_key": "moto-test-secret"}
    bucket = _bucket_name("zm")
    _moto_admin.create_bucket(Bucket=bucket)
    target = S3Target("moto", bucket, options, functools.partial(_moto_client, moto_endpoint))
    yield target
    target.close()
    empty_bucket(_moto_admin, bucket)
    _moto_admin.delete_bucket(Bucket=bucket)


@pytest.fixture(params=["seaweed", "moto"])
def any_s3(request: pytest.FixtureRequest) -> S3Target:
    """The test runs once against SeaweedFS and once against moto."""
    return request.getfixturevalue("s3" if request.param == "seaweed" else "moto_s3")


@pytest.fixture
def s3_proxy(seaweed: SeaweedServer) -> Iterator[Callable[..., tuple[FaultProxy, dict[str, Any]]]]:
    """Factory: `proxy, options = s3_proxy(faults=..., link=..., seed=...)` in front of SeaweedFS.

    `options` are the admin's store options with the endpoint pointed at the proxy. Every proxy
    is stopped at teardown.
    """
    with ExitStack() as stack:

        def make(*, faults: Faults | None = None, link: Link | None = None, seed: int = 0):
            proxy = stack.enter_context(FaultProxy(seaweed.endpoint_url, faults=faults, link=link, seed=seed))
            return proxy, seaweed.store_options(endpoint_url=proxy.url)

        yield make


@pytest.fixture(scope="session")
def offload() -> Iterator[Offload]:
    """The session's second process for a test's independent runs (tests/_offload.py), started on first use."""
    pool = Offload()
    try:
        yield pool
    finally:
        pool.close()
