"""Permanent S3 errors become zephon errors by code, name the object, and never show credentials."""

from __future__ import annotations

import logging

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from zephon_stream import (
    AccessDenied,
    AlreadyExists,
    BucketNotFound,
    ConfigError,
    ConnectorError,
    ObjectNotFound,
    Throttled,
)
from zephon_stream.connectors.s3 import S3Store, translate_error

pytestmark = [pytest.mark.anyio, pytest.mark.s3, pytest.mark.timeout(60)]


def _cause_code(exc: BaseException) -> str:
    assert isinstance(exc.__cause__, ClientError), exc.__cause__
    return exc.__cause__.response["Error"]["Code"]


async def test_missing_key_and_bucket(any_s3) -> None:
    async with S3Store(any_s3.bucket, **any_s3.options) as store:
        with pytest.raises(ObjectNotFound, match=f"s3://{any_s3.bucket}/no/such-key") as err:
            await store.read("no/such-key")
        assert _cause_code(err.value) == "NoSuchKey" and "check the key" in str(err.value)
        with pytest.raises(ObjectNotFound, match="no/such-key"):
            await store.head("no/such-key")  # HEAD has no body: the code is the status, "404"
        with pytest.raises(ObjectNotFound, match="no/such-key"):
            async with store.open_read("no/such-key"):
                pass
    async with S3Store("zephon-no-such-bucket", **any_s3.options) as store:
        for call in (store.read("k"), store.list("p/")):
            # a subclass of ObjectNotFound: the relay exits on it (a setting is wrong), not on a missing key
            with pytest.raises(BucketNotFound, match="bucket 'zephon-no-such-bucket' does not exist") as err:
                await call
            assert _cause_code(err.value) == "NoSuchBucket" and "endpoint_url" in str(err.value)


async def test_access_denied_for_an_identity_without_permission(s3, seaweed) -> None:
    async with S3Store(s3.bucket, **s3.options) as admin:
        await admin.put("secret/plans", b"data")
    async with S3Store(s3.bucket, **seaweed.store_options(limited=True)) as store:
        for call in (store.read("secret/plans"), store.put("secret/plans", b"x"), store.list("secret/")):
            with pytest.raises(AccessDenied, match=f"s3://{s3.bucket}/secret/") as err:
                await call
            assert _cause_code(err.value) == "AccessDenied" and "policy" in str(err.value)
        with pytest.raises(AccessDenied, match="secret/plans"):
            await store.head("secret/plans")


@pytest.mark.parametrize("wrong", ["key", "secret"])
async def test_rejected_credentials_never_leak(s3, caplog: pytest.LogCaptureFixture, wrong: str) -> None:
    key_id = "AKIDLEAKCHECK0000001" if wrong == "key" else s3.options["access_key_id"]
    secret = "s3cr3t-LEAK-CHECK-value-do-not-print"
    options = {**s3.options, "access_key_id": key_id, "secret_access_key": secret}
    caplog.set_level(logging.DEBUG)
    async with S3Store(s3.bucket, **options) as store:
        with pytest.raises(AccessDenied, match=f"s3://{s3.bucket}/k: the credentials were rejected") as err:
            await store.read("k")
        shown = [str(err.value), repr(err.value), repr(store), str(store), str(err.value.__cause__)]
    assert _cause_code(err.value) == ("InvalidAccessKeyId" if wrong == "key" else "SignatureDoesNotMatch")
    for text in shown:
        assert secret not in text and key_id not in text
    assert secret not in caplog.text  # no logger at all, botocore's included, prints the secret
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("zephon_stream"))
    assert key_id not in ours


async def test_no_credentials_at_all(s3, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    async with S3Store(s3.bucket, endpoint_url=s3.options["endpoint_url"]) as store:
        with pytest.raises(AccessDenied, match="no AWS credentials found") as err:
            await store.read("k")
    # it named --to-profile alone, a flag of zephon relay, to users of zephon stream
    said = str(err.value)
    assert "`profile` in a loader source" in said and "`--from-profile`/`--to-profile` of zephon relay" in said


@pytest.mark.parametrize("given", ["option", "env"])
async def test_a_profile_not_in_the_aws_files_is_one_config_error(s3, monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                   given: str) -> None:
    """botocore's ProfileNotFound came out raw: a traceback from `zephon relay --to-profile typo`."""
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    options = {"profile": "nosuch"} if given == "option" else {}
    if given == "env":
        monkeypatch.setenv("AWS_PROFILE", "nosuch")
    async with S3Store(s3.bucket, endpoint_url=s3.options["endpoint_url"], **options) as store:
        with pytest.raises(ConfigError, match=rf"AWS profile 'nosuch' is in neither {tmp_path}/config nor "
                                              rf"{tmp_path}/credentials: check its name"):
            await store.read("k")


def _client_error(code: str, status: int, operation: str = "GetObject") -> ClientError:
    response = {
        "Error": {"Code": code, "Message": "server text that may echo AKIDFROMSERVER"},
        "ResponseMetadata": {"HTTPStatusCode": status, "RetryAttempts": 2},
    }
    return ClientError(response, operation)


@pytest.mark.parametrize(
    ("code", "status", "operation", "expected"),
    [
        ("NoSuchKey", 404, "GetObject", ObjectNotFound),
        ("404", 404, "HeadObject", ObjectNotFound),
        ("NoSuchBucket", 404, "ListObjectsV2", BucketNotFound),
        ("AccessDenied", 403, "GetObject", AccessDenied),
        ("403", 403, "HeadObject", AccessDenied),
        ("InvalidAccessKeyId", 403, "PutObject", AccessDenied),
        ("SignatureDoesNotMatch", 403, "GetObject", AccessDenied),
        ("ExpiredToken", 400, "GetObject", AccessDenied),
        ("PreconditionFailed", 412, "PutObject", AlreadyExists),
        ("ConditionalRequestConflict", 409, "PutObject", AlreadyExists),
        ("PreconditionFailed", 412, "CompleteMultipartUpload", AlreadyExists),
        ("PreconditionFailed", 412, "GetObject", ConnectorError),  # If-Match on a resumed read
        ("SlowDown", 503, "GetObject", Throttled),
        ("InternalError", 500, "GetObject", ConnectorError),
    ],
)
def test_translation_is_by_code(code: str, status: int, operation: str, expected: type) -> None:
    err = translate_error(_client_error(code, status, operation), bucket="bkt", key="some/key",
                          operation=operation, endpoint="http://127.0.0.1:9")
    assert type(err) is expected
    text = str(err)
    assert "s3://bkt/some/key" in text and code in text and "AKIDFROMSERVER" not in text
    if expected is Throttled:
        assert "3 attempts" in text


def test_translation_of_a_connection_failure_says_what_to_check() -> None:
    exc = EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
    err = translate_error(exc, bucket="bkt", key=None, operation="ListObjectsV2",
                          endpoint="http://127.0.0.1:9")
    assert type(err) is ConnectorError and "s3://bkt/" in str(err) and "reachable" in str(err)
