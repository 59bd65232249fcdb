"""The S3 matrix (tests/core/test_s3_sources.py), faults included, for Parquet sources: the same
tests, collected here with `config` the Parquet copy of the text data, uploaded to SeaweedFS.
A lane's ranged reads of footers and column chunks go through the fault proxy like any other."""

from __future__ import annotations

import pytest

from tests.core.test_s3_sources import (  # noqa: F401  (collected here with this module's fixtures)
    VanishingShard,
    _on_endpoint,
    local_baseline,
    test_faults_change_nothing_and_are_counted,
    test_s3_buffer_sizes_and_resume_twice,
    test_s3_matches_local,
    test_s3_with_latency_and_resume_onto_local_world,
    test_sources_on_one_endpoint_share_one_client,
)
from zephon_stream import ObjectNotFound
from zephon_stream.loader.loader import Loader


@pytest.fixture()
def config(parquet_config):
    return parquet_config


@pytest.fixture()
def s3_config(config, parquet_dataset, s3, monkeypatch):
    """`config` with both Parquet sources uploaded to a fresh SeaweedFS bucket (credentials from the env)."""
    client = s3.client()
    for path in sorted(parquet_dataset.glob("[ab]/*.parquet")):
        client.put_object(Bucket=s3.bucket, Key=f"data/{path.parent.name}/{path.name}", Body=path.read_bytes())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.options["secret_access_key"])
    return _on_endpoint(config, s3.bucket, s3.options["endpoint_url"])


def test_a_parquet_file_deleted_after_planning_is_named(s3_config, s3):
    with pytest.raises(ObjectNotFound, match="data/a/a-0.parquet") as info:
        next(iter(Loader(s3_config, backend="threads",
                         wrap_store=lambda store: VanishingShard(store, s3.client(), s3.bucket))))
    assert "NoSuchKey" in str(info.value)
