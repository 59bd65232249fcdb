"""The throwaway SeaweedFS server of the tests (zephon_stream/testing/seaweed.py): its start-up race.

Its ports are found free and released before `weed` binds them, so another process can take one
in between (two servers starting at once did); weed then exits at once, and the server must start
again on fresh ports instead of failing the test that wanted it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import closing

import pytest

from zephon_stream.testing import seaweed
from zephon_stream.testing.seaweed import START_ATTEMPTS, SeaweedServer


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port bound by this process, as by another one between the pick and weed's bind."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _picks(monkeypatch: pytest.MonkeyPatch, taken: int, times: int) -> list[list[int]]:
    """Make the first `times` port picks hand weed's S3 gateway the taken port; returns every pick."""
    picks: list[list[int]] = []
    real = seaweed._free_ports

    def pick(n: int) -> list[int]:
        ports = real(n)
        if len(picks) < times:
            ports[seaweed._COMPONENTS.index("s3")] = taken
        picks.append(ports)
        return ports

    monkeypatch.setattr(seaweed, "_free_ports", pick)
    return picks


def test_a_port_taken_under_weed_is_retried_on_fresh_ports(monkeypatch: pytest.MonkeyPatch, taken: int) -> None:
    picks = _picks(monkeypatch, taken, times=1)
    with SeaweedServer() as server:
        s3_port = picks[1][seaweed._COMPONENTS.index("s3")]
        assert len(picks) == 2 and s3_port != taken and server.endpoint_url == f"http://127.0.0.1:{s3_port}"
        server.create_bucket("after-a-retry")
        with closing(server.client()) as client:
            client.put_object(Bucket="after-a-retry", Key="k", Body=b"served")
            assert client.get_object(Bucket="after-a-retry", Key="k")["Body"].read() == b"served"
        server.delete_bucket("after-a-retry")


def test_it_gives_up_after_a_bounded_number_of_starts(monkeypatch: pytest.MonkeyPatch, taken: int) -> None:
    assert START_ATTEMPTS >= 2
    monkeypatch.setattr(seaweed, "START_ATTEMPTS", 2)  # the bound as a smaller one: each start costs a weed exit
    picks = _picks(monkeypatch, taken, times=2)
    server = SeaweedServer()
    with pytest.raises(RuntimeError, match=rf"exited during startup(.|\n)*{taken}(.|\n)*after 2 starts"):
        server.start()
    assert len(picks) == 2 and not server.workdir.exists()  # stopped and cleaned up
