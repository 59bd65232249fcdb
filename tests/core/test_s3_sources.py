"""The determinism matrix with sources on a real S3 server (SeaweedFS), through aiobotocore:
per-sample digests equal the local-store run of the same data, with and without injected faults."""

from __future__ import annotations

import logging
import threading

import anyio
import msgspec
import pytest

from zephon_stream import AccessDenied, ConfigError, ObjectNotFound
from zephon_stream.loader.loader import Loader
from zephon_stream.testing.determinism import batch_records, run_world
from zephon_stream.testing.proxy import FAULT_KINDS, Faults
from zephon_stream.testing.stores import WithLatency

STEPS = 12


@pytest.fixture()
def s3_config(config, dataset, s3, monkeypatch):
    """`config` with both sources uploaded to a fresh SeaweedFS bucket (credentials from the env)."""
    root, _ = dataset
    client = s3.client()
    for path in sorted(root.glob("[ab]/*")):
        client.put_object(Bucket=s3.bucket, Key=f"data/{path.parent.name}/{path.name}", Body=path.read_bytes())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.options["secret_access_key"])
    return _on_endpoint(config, s3.bucket, s3.options["endpoint_url"])


def _on_endpoint(config, bucket: str, endpoint: str):
    return config.replace(sources=[
        msgspec.structs.replace(src, uri=f"s3://{bucket}/data/{src.name}/", endpoint_url=endpoint, region="us-east-1",
                                addressing_style="path") for src in config.sources])


_LOCAL: dict[str, list] = {}  # config TOML -> records of its local inline run (a pure function of the config)


@pytest.fixture()
def local_baseline(config):
    """The local inline run's records: computed once per config and session, not again in each test."""
    key = config.to_toml()
    if key not in _LOCAL:
        _LOCAL[key] = run_world(config, 1, STEPS, backend="inline")[0]
    return list(_LOCAL[key])


@pytest.mark.parametrize(("dp_size", "backend"), [(1, "threads"), (3, "inline"), (2, "processes")])
def test_s3_matches_local(s3_config, local_baseline, dp_size, backend):
    assert run_world(s3_config, dp_size, STEPS, backend=backend)[0] == local_baseline


def test_s3_with_latency_and_resume_onto_local_world(s3_config, local_baseline):
    first, states = run_world(s3_config, 4, 5, backend="threads", wrap_store=WithLatency(seed=5, max_ms=3))
    rest, _ = run_world(s3_config, 2, STEPS - 5, backend="inline", resume=states)
    assert first + rest == local_baseline


def test_faults_change_nothing_and_are_counted(s3_config, local_baseline, s3, s3_proxy):
    proxy, options = s3_proxy(faults=Faults.every_kind(0.05), seed=11)
    for kind in FAULT_KINDS:  # every kind at least once (on reads), then 5% of requests at random
        proxy.inject(kind, method="GET", match="Range: bytes=")
    cfg = _on_endpoint(s3_config, s3.bucket, options["endpoint_url"])
    loader = Loader(cfg, backend="threads")
    records = []
    for batch in loader:
        records += batch_records(batch)
        if loader.step == STEPS:
            stats = loader.statistics()
            break
    assert records == local_baseline
    faults = proxy.statistics().faults
    assert set(faults) == set(FAULT_KINDS), faults
    assert stats.store_retries > 0, stats


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_an_s3_outage_is_ridden_out_and_changes_nothing(s3_config, local_baseline, s3, s3_proxy, caplog, monkeypatch,
                                                        backend):
    """S3 away for 4 s from the end of planning, longer than a request's 2 attempts: the loader waits
    it out (a warning when it starts and when it ends) and its batches are those of the local run.
    With processes, the workers' first requests meet the outage: the parent's plan says the endpoint
    answered."""
    import zephon_stream.loader.loader as loader_module

    proxy, options = s3_proxy()
    cfg = _on_endpoint(s3_config, s3.bucket, options["endpoint_url"])
    cfg = cfg.replace(sources=[msgspec.structs.replace(src, max_attempts=2, retry_deadline=60) for src in cfg.sources])
    planned = loader_module.plan_data

    async def plan_then_outage(*args, **kwargs):
        plan = await planned(*args, **kwargs)
        proxy.set_faults(Faults(reset_before_response=1.0))
        threading.Timer(4.0, proxy.set_faults, [Faults()]).start()
        return plan

    monkeypatch.setattr(loader_module, "plan_data", plan_then_outage)
    with caplog.at_level(logging.WARNING, logger="zephon_stream.connectors.s3"):
        records, _ = run_world(cfg, 1, STEPS, backend=backend)
    assert records == local_baseline
    assert proxy.statistics().faults["reset_before_response"] >= 2
    if backend == "threads":  # a worker's log lines stay in its process
        said = [r.getMessage() for r in caplog.records]
        assert any("failed after 2 attempts" in m and "retried until retry_deadline = 60 s" in m for m in said), said
        assert any("answers again" in m for m in said), said


def test_s3_buffer_sizes_and_resume_twice(s3_config, local_baseline):
    tiny = s3_config.replace(sample_buffer=1, doc_buffer=1, sample_batch=1, tokenize_batch=3, cpu_threads=1)
    a, s1 = run_world(tiny, 6, 3, backend="threads")
    b, s2 = run_world(s3_config.replace(doc_buffer=16, sample_buffer=16), 2, 4, backend="inline", resume=s1)
    c, _ = run_world(s3_config, 1, STEPS - 7, backend="threads", resume=s2)
    assert a + b + c == local_baseline


class VanishingShard:
    """A store whose listing is followed by another client deleting a shard: NoSuchKey on read."""

    def __init__(self, inner, client, bucket):
        self.inner, self.client, self.bucket = inner, client, bucket

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def list(self, prefix=""):
        objects = await self.inner.list(prefix)
        if prefix.endswith("/a/"):
            self.client.delete_object(Bucket=self.bucket, Key=objects[0].key)
        return objects


@pytest.mark.parametrize(("change", "error", "code", "needle"), [
    ("bucket", ObjectNotFound, "NoSuchBucket", "no-such-bucket-zz"),
    ("key", ObjectNotFound, "NoSuchKey", "data/a/a-0.jsonl"),
    ("identity", AccessDenied, "AccessDenied", "data/a/"),
    ("key-id", AccessDenied, "InvalidAccessKeyId", "check"),
    ("secret", AccessDenied, "SignatureDoesNotMatch", "check"),
])
def test_permanent_errors_stop_the_loader_naming_the_object(s3_config, s3, seaweed, monkeypatch, change, error,
                                                            code, needle):
    cfg, wrap = s3_config, None
    if change == "bucket":
        cfg = s3_config.replace(sources=[msgspec.structs.replace(s3_config.sources[0], uri="s3://no-such-bucket-zz/a/")])
    elif change == "key":
        def wrap(store):
            return VanishingShard(store, s3.client(), s3.bucket)
    elif change == "identity":  # a valid identity without permission on the bucket
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.limited_access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.limited_secret_key)
    elif change == "key-id":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDNOSUCHKEY0000001")
    else:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(error, match=needle) as info:
        next(iter(Loader(cfg, backend="threads", wrap_store=wrap)))
    assert code in str(info.value)  # the server's error code, named in the message
    for secret in ("wrong-secret", seaweed.limited_secret_key, "AKIDNOSUCHKEY0000001"):
        assert secret not in str(info.value)


def test_sources_on_one_endpoint_share_one_client(s3_config):
    """One client per endpoint and credentials, and one limiter, whatever the number of sources."""

    async def main():
        loader = Loader(s3_config, backend="threads")
        async with loader.open() as stream:
            await stream.__anext__()
            pools = {id(store._pool) for store in loader._store_stats}
            clients = sorted(len(store._pool._clients) for store in loader._store_stats)
        return pools, clients

    pools, clients = anyio.run(main)
    assert len(s3_config.sources) == 2 and len(pools) == 1 and clients == [1, 1]


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_a_source_reads_with_the_credentials_of_its_profile(s3_config, local_baseline, s3, seaweed, monkeypatch,
                                                             tmp_path, backend):
    """The keys that may read the bucket are only in a profile of the AWS files; the environment's
    are refused by the server. A source with the profile reads with its keys, one without does not."""
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[corpus-reader]\naws_access_key_id = {s3.options['access_key_id']}\n"
                           f"aws_secret_access_key = {s3.options['secret_access_key']}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.limited_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.limited_secret_key)
    a, b = (msgspec.structs.replace(src, profile="corpus-reader") for src in s3_config.sources)
    assert run_world(s3_config.replace(sources=[a, b]), 1, STEPS, backend=backend)[0] == local_baseline
    with pytest.raises(AccessDenied, match=r"s3://.*/data/b/"):  # b with the environment's keys
        run_world(s3_config.replace(sources=[a, msgspec.structs.replace(b, profile=None)]), 1, STEPS,
                  backend=backend)
    misspelt = s3_config.replace(sources=[msgspec.structs.replace(a, profile="corpus-reder"), b])
    with pytest.raises(ConfigError, match=r"AWS profile 'corpus-reder' is in neither .*config nor .*credentials"):
        run_world(misspelt, 1, STEPS, backend=backend)
