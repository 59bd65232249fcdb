"""S3, or any S3-compatible endpoint (MinIO, R2, SeaweedFS, moto), as an object store.

    async with S3Store("bucket", endpoint_url="http://127.0.0.1:8333", region="us-east-1") as store:
        data = await store.read("shards/0001.jsonl.zst", 0, 1 << 20)     # one ranged GET
        async with store.open_read("weights/v7/chunk-3") as parts:        # bounded read-ahead
            async for part in parts:                                      # bytes, in order
                ...

Configuration follows the AWS conventions: credentials come from the standard chain (env,
shared files, SSO, instance metadata) unless `access_key_id`/`secret_access_key`/`session_token`
or `profile` are given; the endpoint is `endpoint_url`, else `AWS_ENDPOINT_URL_S3`, else
`AWS_ENDPOINT_URL`, else AWS. Credentials never appear in a repr, a log line or an error.

One aiobotocore client per endpoint (and region, addressing style, credentials, retry and
timeout settings) lives in an `S3ClientPool`: entered once, on first use, and closed once, by
the pool's `aclose()`. A store owns a private pool unless several stores share one (`pool=`);
the pool's CapacityLimiter bounds the requests in flight across all of them. A pool belongs to
the event loop that first uses it.

Retries come in two layers. botocore's "standard" mode retries each request: 500/502/503/504,
SlowDown and other throttling codes, RequestTimeout, connection resets and errors, and any
non-streamed response body that breaks or comes up short, with exponential backoff and full
jitter. This module adds, on top, what botocore cannot do:

- a GET body is streamed after botocore has returned, so a body that breaks or ends before its
  Content-Length is resumed here with a ranged GET of the remainder, pinned to the first
  response's ETag (`If-Match`) so the parts cannot come from two versions;
- a deadline (`retry_deadline`): no retry or resume starts once an operation has run that long
  (botocore only bounds attempts);
- an outage is ridden out: once an endpoint has answered a client of the pool, a request that still fails
  with a refused or dropped connection, a 5xx or throttling after botocore's `max_attempts` is
  tried again, with backoff, until `retry_deadline` (logged when it starts and when it ends). A
  training job then survives S3 being away for a minute. An endpoint that never answered (a
  wrong host, a server that is down at the start) still fails after `max_attempts`;
- a stalled endpoint fails fast: a request that timed out (`connect_timeout`, or `read_timeout`
  between bytes) `timeout_attempts` times is not retried again, and the error names the
  operation, the object and the timeout;
- a conditional put whose response was lost and retried can find its own write in place
  (412, or NoSuchUpload); an id in the object's metadata tells its own write from a rival's;
- aiohttp's silent one-time resend of an idempotent request on a dropped keep-alive connection
  is turned off, so every retry follows the one policy above and is counted in `statistics()`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import os
import random
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal

import aiohttp
import anyio
import botocore.loaders
import msgspec
from aiobotocore.config import AioConfig
from aiobotocore.httpsession import AIOHTTPSession
from aiobotocore.session import AioSession
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

from zephon_stream.connectors.base import ObjectInfo, Store, StoreStatistics
from zephon_stream.engine.window import ReadWindow
from zephon_stream.errors import (
    AccessDenied,
    AlreadyExists,
    BucketNotFound,
    ConfigError,
    ConnectorError,
    ObjectNotFound,
    Throttled,
    unwrap_groups,
)

__all__ = ["PartStream", "S3ClientPool", "S3Settings", "S3Store", "translate_error"]

log = logging.getLogger(__name__)
MiB = 1 << 20


class S3Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Tuning of one store. Every size is in bytes, every time in seconds."""

    part_size: int = 8 * MiB  # one ranged GET of `open_read`
    read_ahead: int = 4  # parts of one `open_read` in flight or waiting to be consumed
    max_in_flight: int = 64  # requests in flight across the pool (its CapacityLimiter)
    multipart_threshold: int = 64 * MiB  # `put` of at least this many bytes uses multipart upload
    multipart_part_size: int = 16 * MiB  # S3 needs >= 5 MiB for all parts but the last
    multipart_concurrency: int = 4  # parts of one multipart upload in flight
    list_page_size: int = 1000  # MaxKeys of one ListObjectsV2 page
    max_attempts: int = 5  # attempts of one request (botocore standard mode), and body resumes
    retry_deadline: float = 120.0  # no retry or resume starts after an operation ran this long (an outage
    # of an endpoint that answered before is retried until then)
    resume_backoff: float = 0.05  # base of the jittered exponential backoff between resumes
    connect_timeout: float = 10.0  # to open a connection
    read_timeout: float = 30.0  # between two reads of a response: a stalled endpoint, not a slow one
    timeout_attempts: int = 2  # attempts of a request that keeps timing out, before it fails

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"S3Settings.{name} must be > 0, got {value!r}")
        if self.multipart_part_size < 5 * MiB:
            raise ConfigError(f"S3Settings.multipart_part_size must be >= 5 MiB (S3's minimum part), "
                              f"got {self.multipart_part_size}")


class _Secret:
    """A credential string that never shows itself in a repr or a log line."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "<hidden>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Secret) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


class _ClientKey(msgspec.Struct, frozen=True):
    """What makes two stores need different clients. Hashable; credentials are `_Secret`s."""

    endpoint_url: str | None
    region: str | None
    addressing_style: str
    profile: str | None
    access_key_id: Any  # _Secret | None
    secret_access_key: Any
    session_token: Any
    max_attempts: int
    connect_timeout: float
    read_timeout: float


# -- statistics and per-operation context ------------------------------------------------------


class _Counters:
    __slots__ = ("requests", "bytes_read", "bytes_written", "retries", "in_flight", "peak_in_flight")

    def __init__(self) -> None:
        self.requests = self.bytes_read = self.bytes_written = 0
        self.retries = self.in_flight = self.peak_in_flight = 0


class _Operation:
    """One store call: where botocore's event hooks count attempts, and when retrying stops."""

    __slots__ = ("counters", "deadline", "timeout_attempts")

    def __init__(self, counters: _Counters, deadline: float, timeout_attempts: int) -> None:
        self.counters = counters
        self.deadline = deadline
        self.timeout_attempts = timeout_attempts


_CURRENT: contextvars.ContextVar[_Operation | None] = contextvars.ContextVar("zephon_s3_op", default=None)


def _on_request_created(request: Any, **_: Any) -> None:
    """botocore hook, once per HTTP attempt: attempts after the first are retries."""
    op = _CURRENT.get()
    if op is not None:
        op.counters.requests += 1
        if request.context.get("retries", {}).get("attempt", 1) > 1:
            op.counters.retries += 1


def _on_needs_retry(caught_exception: BaseException | None = None, request_dict: Any = None,
                    **_: Any) -> bool | None:
    """botocore hook, runs before the standard retry handler: veto retries past the deadline, and
    of a request that timed out `timeout_attempts` times (counted in the request's context)."""
    op = _CURRENT.get()
    if op is None:
        return None
    if time.monotonic() >= op.deadline:
        return False
    if isinstance(caught_exception, _TIMEOUTS) and request_dict is not None:
        context = request_dict["context"]
        context["zephon_timeouts"] = context.get("zephon_timeouts", 0) + 1
        if context["zephon_timeouts"] >= op.timeout_attempts:
            return False
    return None


# -- error translation ---------------------------------------------------------------------------

_NOT_FOUND = {"NoSuchKey", "NotFound", "404"}
_DENIED = {"AccessDenied", "Forbidden", "403", "AllAccessDisabled", "AccountProblem"}
_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
_LOST_RACE = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
_OWN_WRITE = {"PreconditionFailed", "412", "NoSuchUpload"}  # a retried conditional put may meet itself
_PUT_ID = "zephon-put-id"
_THROTTLED = {
    "SlowDown", "503", "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestLimitExceeded",
}
_TRANSIENT = (
    BotoConnectionError,
    HTTPClientError,
    ReadTimeoutError,
    ResponseStreamingError,
    IncompleteReadError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientConnectionError,
    ConnectionError,
    TimeoutError,
)


_TIMEOUTS = (ConnectTimeoutError, ReadTimeoutError)
_OUTAGE_BACKOFF = 0.5, 8.0  # seconds: the first wait between two tries through an outage, and the longest


def _outage(exc: BaseException) -> bool:
    """Whether `exc` (what botocore raised once its attempts ran out) looks like an endpoint that is
    away for a while: a refused, reset or dropped connection, a 5xx, or throttling. Not a timeout:
    a stalled endpoint fails after `timeout_attempts`, as its settings say."""
    if isinstance(exc, _TIMEOUTS):
        return False
    if isinstance(exc, ClientError):  # as botocore's own retries: not a 501 (a feature the endpoint lacks)
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return _code(exc) in _THROTTLED or status in (500, 502, 503, 504)
    return isinstance(exc, (BotoConnectionError, HTTPClientError, aiohttp.ClientConnectionError, ConnectionError))


def _attempts(exc: BaseException, max_attempts: int) -> str:
    """How many attempts botocore made: as the response says, else (a connection error, retried
    to the bound) `max_attempts`."""
    n = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) + 1 if isinstance(exc, ClientError) \
        else max_attempts
    return f"{n} attempt{'s' if n != 1 else ''}"


def _what(exc: BaseException) -> str:
    """A failure in a few words: its S3 error code and HTTP status, or its type."""
    if isinstance(exc, ClientError):
        return f"{_code(exc)}, HTTP {exc.response.get('ResponseMetadata', {}).get('HTTPStatusCode', '?')}"
    return type(exc).__name__


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def translate_error(
    exc: Exception, *, bucket: str, key: str | None, operation: str, endpoint: str,
    settings: S3Settings | None = None,
) -> ConnectorError:
    """The zephon error for a botocore/aiohttp failure, chosen by S3 error code (never message text).

    `operation` is the S3 API name (GetObject, PutObject, ...). The message names the object and
    what to check; it never includes credentials or the server's message (which may echo them).
    A timeout names the setting that ran out (from `settings`, the store's).
    """
    where = f"s3://{bucket}/{key}" if key is not None else f"s3://{bucket}/"
    at = f" at {endpoint}" if endpoint else ""
    if isinstance(exc, _TIMEOUTS):
        return _timeout_error(exc, f"{operation} {where}{at}", settings or S3Settings())
    if isinstance(exc, NoCredentialsError):
        return AccessDenied(
            f"{operation} {where}: no AWS credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or name a profile (`profile` in a loader source, `--profile` of zephon refit and zephon "
            "shard, `--from-profile`/`--to-profile` of zephon relay, or profile= in Python)"
        )
    if not isinstance(exc, ClientError):
        return ConnectorError(
            f"{operation} {where}{at} failed: {type(exc).__name__} after retries; "
            "check that the endpoint is reachable and healthy"
        )
    code = _code(exc)
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
    attempts = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) + 1
    detail = f"(HTTP {status})" if code == str(status) else f"({code}, HTTP {status})"
    if code == "NoSuchBucket":
        return BucketNotFound(f"{operation} {where}: bucket {bucket!r} does not exist{at} {detail}; "
                              "check the bucket name, endpoint_url and region")
    if code in _NOT_FOUND:
        return ObjectNotFound(f"{operation} {where}: no such object{at} {detail}; check the key, the prefix "
                              f"and that bucket {bucket!r} exists")
    if code in _BAD_CREDENTIALS:
        return AccessDenied(f"{operation} {where}: the credentials were rejected{at} {detail}; check the "
                            "access key id and secret (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the "
                            "profile), session token expiry, and the clock")
    if code in _DENIED:
        return AccessDenied(f"{operation} {where}: access denied{at} {detail}; check the IAM and bucket "
                            f"policy for these credentials on bucket {bucket!r}")
    if code in _LOST_RACE and operation in ("PutObject", "CompleteMultipartUpload"):
        return AlreadyExists(f"{operation} {where}: the object already exists {detail}; a conditional put "
                             "(If-None-Match: *) only creates new objects")
    if code in _LOST_RACE:
        return ConnectorError(f"{operation} {where}: the object changed while it was read {detail}; "
                              "read it again")
    if code in _THROTTLED:
        return Throttled(f"{operation} {where}{at} kept throttling after {attempts} attempts {detail}; lower "
                         "max_in_flight or spread keys over more prefixes")
    return ConnectorError(f"{operation} {where}{at} failed after {attempts} attempts {detail}")


def _timeout_error(exc: BaseException, what: str, s: S3Settings) -> ConnectorError:
    if isinstance(exc, ConnectTimeoutError):
        setting, value, happened = "connect_timeout", s.connect_timeout, "could not connect"
    else:
        setting, value, happened = "read_timeout", s.read_timeout, "stalled: no bytes came"
    return ConnectorError(f"{what} {happened} within {setting} = {value:g} s (timeout_attempts = "
                          f"{s.timeout_attempts}); check that the endpoint is up and reachable, or raise "
                          f"{setting} (in the source's table of the config)")


# -- client pool -------------------------------------------------------------------------------


class S3ClientPool:
    """aiobotocore clients, one per endpoint/credentials, and the limiter on requests in flight.

    An async context manager: each client is entered once, on first use, and every client is
    closed once, by `aclose()`. Share one pool among stores to share connections and the limit.
    """

    def __init__(self, *, max_in_flight: int = 64) -> None:
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
        self.limiter = anyio.CapacityLimiter(max_in_flight)
        self._clients: dict[_ClientKey, Any] = {}
        self.answered: set[_ClientKey] = set()  # clients whose endpoint answered: a failure now is an outage
        self._stack = AsyncExitStack()
        self._lock = anyio.Lock()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        endpoints = sorted({k.endpoint_url or "aws" for k in self._clients})
        n, limit = len(self._clients), self.limiter.total_tokens
        return f"S3ClientPool(clients={n}, endpoints={endpoints}, max_in_flight={limit})"

    async def client(self, key: _ClientKey) -> Any:
        """The client for `key`, created and entered on first use."""
        loop = asyncio.get_running_loop()  # aiobotocore runs on asyncio only
        if self._loop is not loop and self._loop is not None:
            raise ConnectorError(f"{self!r} was opened on another event loop: its connections belong to that "
                                 "loop; open one store (or pool) per event loop")
        async with self._lock:
            if self._closed:
                raise ConnectorError(f"{self!r} is closed: open a new store or pool")
            if key not in self._clients:
                self._loop = loop
                try:
                    client = _create_client(key, self.limiter.total_tokens)
                    self._clients[key] = await self._stack.enter_async_context(client)
                except ProfileNotFound as exc:  # a name given here, or in AWS_PROFILE
                    files = " nor ".join(os.environ.get(var, default) for var, default in (
                        ("AWS_CONFIG_FILE", "~/.aws/config"), ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")))
                    raise ConfigError(f"AWS profile {exc.kwargs.get('profile')!r} is in neither {files}: check "
                                      "its name (the profile setting, or AWS_PROFILE)") from None
            return self._clients[key]

    async def aclose(self) -> None:
        self._closed = True
        self._clients.clear()
        await self._stack.aclose()

    async def __aenter__(self) -> S3ClientPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _VisibleRetriesSession(AIOHTTPSession):
    """aiohttp resends an idempotent request once, silently, when a reused connection drops.

    botocore never sees that resend: it is not counted, not backed off, and it lets a
    conditional PUT meet its own write without knowing it retried. Turning it off leaves every
    retry to botocore. `_retry_connection` is aiohttp's own switch (its test utilities use it).
    """

    async def _get_session(self, proxy_url: Any) -> Any:
        session = await super()._get_session(proxy_url)
        if hasattr(session, "_retry_connection"):
            session._retry_connection = False
        return session


def _create_client(key: _ClientKey, max_connections: int) -> Any:
    config = AioConfig(
        http_session_cls=_VisibleRetriesSession,
        region_name=key.region,
        s3={"addressing_style": key.addressing_style},
        retries={"mode": "standard", "total_max_attempts": key.max_attempts},
        connect_timeout=key.connect_timeout,
        read_timeout=key.read_timeout,
        max_pool_connections=max_connections,
        # Bodies are checked by length and pinned by ETag here; digests are the caller's job.
        # "when_supported" would wrap GET bodies in a checksum that a resumed range cannot use.
        response_checksum_validation="when_required",
    )
    def secret(s):
        return s.value if s is not None else None
    session = AioSession(profile=key.profile) if key.profile else AioSession()
    session.register_component("data_loader", _shared_loader())  # parse botocore's JSON models once
    client_cm = session.create_client(
        "s3",
        endpoint_url=key.endpoint_url,
        aws_access_key_id=secret(key.access_key_id),
        aws_secret_access_key=secret(key.secret_access_key),
        aws_session_token=secret(key.session_token),
        config=config,
    )
    return _HookedClient(client_cm)


@functools.cache
def _shared_loader() -> Any:
    return botocore.loaders.create_loader()


class _HookedClient:
    """Enters the aiobotocore client and registers our retry-accounting and deadline hooks."""

    def __init__(self, client_cm: Any) -> None:
        self._cm = client_cm

    async def __aenter__(self) -> Any:
        client = await self._cm.__aenter__()
        client.meta.events.register("request-created.s3", _on_request_created)
        client.meta.events.register_first("needs-retry.s3", _on_needs_retry)
        return client

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._cm.__aexit__(*exc)


# -- the store ---------------------------------------------------------------------------------


class _Pin:
    """The one object version (ETag, quoted for If-Match) that every part of a read must come from."""

    def __init__(self, key: str, etag: str | None) -> None:
        self.key = key
        self.etag = _quoted(etag) if etag else None

    def check(self, etag: str | None, bucket: str) -> None:
        if etag is None:  # the part lay past the end of the object: no response to compare
            return
        if self.etag is None:
            self.etag = _quoted(etag)
        elif _quoted(etag) != self.etag:
            raise ConnectorError(f"s3://{bucket}/{self.key} changed while it was read (ETag {self.etag} "
                                 f"then {etag}); read it again")


class PartStream:
    """Parts of an `open_read`, in order, from a `ReadWindow`: taking one starts the next request."""

    def __init__(self, window: ReadWindow) -> None:
        self._window = window

    def __aiter__(self) -> PartStream:
        return self

    async def __anext__(self) -> bytes:
        while True:
            data = await anext(self._window)  # StopAsyncIteration after the last part
            if data:  # parts past the end of a shorter object than `end` said are empty
                return data


class S3Store:
    """The objects of one bucket. Keys are relative to the bucket; `open_store` adds prefixes.

    Options: `endpoint_url`, `region`, `addressing_style` ("path", "virtual" or "auto"; default
    "path" with a custom endpoint, else "auto"), credentials (`access_key_id`,
    `secret_access_key`, `session_token`, or `profile`; default: the AWS chain), `pool` (an
    `S3ClientPool` to share), `settings` (an `S3Settings`), any `S3Settings` field by name, and
    `answered` (the endpoint is known to answer: an outage is ridden out from the first request).
    """

    overlap_reads = True  # a round trip a request: the split readers keep `read_ahead` in flight

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: Literal["path", "virtual", "auto"] | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        pool: S3ClientPool | None = None,
        settings: S3Settings | None = None,
        answered: bool = False,
        **overrides: Any,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"bucket name {bucket!r} is invalid: pass the bucket alone, "
                              "e.g. S3Store('my-bucket')")
        self.bucket = bucket
        self.settings = _settings(settings, overrides)
        env = os.environ
        endpoint_url = endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        if endpoint_url and not (is_valid_endpoint_url(endpoint_url) or is_valid_ipv6_endpoint_url(endpoint_url)):
            raise ConfigError(f"endpoint_url {endpoint_url!r} is not a URL: use http://host:port or https://host")
        style = addressing_style or ("path" if endpoint_url else "auto")
        if style not in ("path", "virtual", "auto"):
            raise ConfigError(f"addressing_style must be 'path', 'virtual' or 'auto', got {style!r}")
        if (access_key_id is None) != (secret_access_key is None):
            raise ConfigError("pass access_key_id and secret_access_key together "
                              "(or neither, for the AWS credential chain)")
        def hide(v):
            return _Secret(v) if v is not None else None
        s = self.settings
        region = region or ("us-east-1" if endpoint_url else None)
        self._key = _ClientKey(endpoint_url, region, style, profile,
                               hide(access_key_id), hide(secret_access_key), hide(session_token),
                               s.max_attempts, s.connect_timeout, s.read_timeout)
        self._own_pool = pool is None
        self._pool = pool if pool is not None else S3ClientPool(max_in_flight=self.settings.max_in_flight)
        self._counters = _Counters()
        if answered:  # known to answer (a loader's worker: its parent planned the data through it)
            self._pool.answered.add(self._key)
        self._down_since: float | None = None  # when the outage being ridden out began

    def __repr__(self) -> str:
        where = self._key.endpoint_url or "aws"
        k = self._key
        return (f"S3Store({self.bucket!r}, endpoint={where!r}, region={k.region!r}, "
                f"addressing_style={k.addressing_style!r})")

    @property
    def endpoint(self) -> str:
        return self._key.endpoint_url or "AWS"

    # -- plumbing ------------------------------------------------------------------------------

    @asynccontextmanager
    async def _operation(self) -> AsyncIterator[_Operation]:
        """Scope of one store call: botocore's hooks see it through a context variable."""
        current = _CURRENT.get()
        if current is not None and current.counters is self._counters:
            yield current
            return
        s = self.settings
        op = _Operation(self._counters, time.monotonic() + s.retry_deadline, s.timeout_attempts)
        token = _CURRENT.set(op)
        try:
            yield op
        finally:
            _CURRENT.reset(token)

    @asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """One request in flight: holds a token of the pool's limiter."""
        async with self._pool.limiter:
            c = self._counters
            c.in_flight += 1
            c.peak_in_flight = max(c.peak_in_flight, c.in_flight)
            try:
                yield
            finally:
                c.in_flight -= 1

    async def _call(self, method: str, key: str | None, **params: Any) -> Any:
        """One S3 API call (botocore retries inside), errors translated. Call inside `_slot`.

        Once the endpoint has answered a client of the pool, a call whose attempts all met an outage
        (`_outage`) is made again, with backoff, until the operation's `retry_deadline`."""
        client = await self._pool.client(self._key)
        op, tries = _CURRENT.get(), 0
        while True:
            try:
                resp = await getattr(client, method)(Bucket=self.bucket, **params)
            except (BotoCoreError, ClientError, aiohttp.ClientError) as exc:
                op_name = client.meta.method_to_api_mapping.get(method, method)
                if isinstance(exc, ClientError) and not _outage(exc):
                    self._pool.answered.add(self._key)  # a 404 or a 412 is an answer too
                wait = self._outage_wait(op, exc, tries)
                if wait is None:
                    err = translate_error(exc, bucket=self.bucket, key=key, operation=op_name,
                                          endpoint=self.endpoint, settings=self.settings)
                    raise err from exc
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    log.warning("S3 endpoint %s: %s s3://%s/%s failed after %s (%s); it answered before, so it "
                                "is retried until retry_deadline = %g s", self.endpoint, op_name, self.bucket,
                                key or "", _attempts(exc, self.settings.max_attempts), _what(exc),
                                self.settings.retry_deadline)
                tries += 1
                if op is not None:
                    op.counters.retries += 1
                await self._wait_unslotted(wait)
                continue
            self._pool.answered.add(self._key)
            if self._down_since is not None:
                log.warning("S3 endpoint %s answers again, after %.1f s", self.endpoint,
                            time.monotonic() - self._down_since)
                self._down_since = None
            return resp

    async def _wait_unslotted(self, seconds: float) -> None:
        """Sleep through an outage without the request slot `_call`'s caller holds (`_slot`): the
        pool's limiter is shared by every store of the pool, and another endpoint may be up."""
        limiter, c = self._pool.limiter, self._counters
        limiter.release()
        c.in_flight -= 1
        try:
            await anyio.sleep(seconds)
        finally:
            with anyio.CancelScope(shield=True):  # the caller's `async with` releases it again, cancelled or not
                await limiter.acquire()
            c.in_flight += 1

    def _outage_wait(self, op: _Operation | None, exc: BaseException, tries: int) -> float | None:
        """How long to wait before trying a failed call again through an outage, or None to fail."""
        left = op.deadline - time.monotonic() if op is not None else 0.0
        if not (self._key in self._pool.answered and left > 0 and _outage(exc)):
            return None
        first, longest = _OUTAGE_BACKOFF
        return min(left, random.uniform(0.5, 1.0) * min(longest, first * 2**tries))

    async def _request(self, method: str, key: str | None, **params: Any) -> Any:
        async with self._operation(), self._slot():
            return await self._call(method, key, **params)

    async def _backoff(self, op: _Operation, attempt: int, what: str, exc: BaseException, timeouts: int = 0) -> None:
        """Count one retry of ours, or raise when attempts, time or `timeout_attempts` ran out."""
        if isinstance(exc, _TIMEOUTS) and timeouts >= self.settings.timeout_attempts:
            raise _timeout_error(exc, f"{what} at {self.endpoint}", self.settings) from exc
        if attempt >= self.settings.max_attempts or time.monotonic() >= op.deadline:
            raise ConnectorError(f"{what}: gave up after {attempt} attempts: {type(exc).__name__}; "
                                 f"check the network path to {self.endpoint}") from exc
        op.counters.retries += 1
        log.debug("%s: %s, retrying (attempt %d)", what, type(exc).__name__, attempt + 1)
        await anyio.sleep(random.uniform(0, self.settings.resume_backoff * 2**attempt))

    # -- the Store protocol --------------------------------------------------------------------

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        params: dict[str, Any] = {"Prefix": prefix, "MaxKeys": self.settings.list_page_size}
        while True:
            page = await self._request("list_objects_v2", prefix, **params)
            out += [_info(o["Key"], o["Size"], o["ETag"]) for o in page.get("Contents", ())]
            if not page.get("IsTruncated"):
                return sorted(out, key=lambda o: o.key)
            params["ContinuationToken"] = page["NextContinuationToken"]

    async def head(self, key: str) -> ObjectInfo:
        resp = await self._request("head_object", key, Key=key)
        return _info(key, resp["ContentLength"], resp["ETag"])

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes `[start, end)` of `key` (`end=None`: to the end), with one ranged GET."""
        if start < 0 or (end is not None and end < start):
            raise ConfigError(f"invalid range [{start}, {end}) for s3://{self.bucket}/{key}")
        if end == start:
            await self.head(key)  # same errors as a real read
            return b""
        async with self._operation() as op:
            data, _ = await self._get(op, key, start, end, None)
            return data

    async def _get(self, op: _Operation, key: str, start: int, end: int | None,
                   etag: str | None) -> tuple[bytes, str | None]:
        """GET `[start, end)` and the object's ETag. A body that breaks is resumed from its last
        byte, pinned with If-Match to the ETag of the first response (or to `etag`, if given)."""
        chunks: list[bytes] = []
        pos, attempt, timeouts = start, 0, 0
        while True:
            params: dict[str, Any] = {"Key": key}
            if pos or end is not None:
                params["Range"] = f"bytes={pos}-{'' if end is None else end - 1}"
            if etag is not None:
                params["IfMatch"] = etag
            async with self._slot():
                try:
                    resp = await self._call("get_object", key, **params)
                except ConnectorError as exc:
                    if _code_of(exc) == "InvalidRange":  # start at or past the end of the object
                        return b"".join(chunks), etag
                    raise
                etag = etag or resp["ETag"]
                body = resp["Body"]
                try:
                    if "Range" in params and not resp.get("ContentRange", "").startswith(f"bytes {pos}-"):
                        got = resp.get("ContentRange")
                        raise ConnectorError(f"GET s3://{self.bucket}/{key}: asked for bytes from {pos}, got "
                                             f"{got!r}; the endpoint ignores Range requests")
                    await self._drain(body, chunks, resp["ContentLength"])
                    return b"".join(chunks), etag
                except _TRANSIENT as exc:
                    pos = start + sum(map(len, chunks))
                    failure: BaseException = exc
                    timeouts += isinstance(exc, _TIMEOUTS)
                finally:
                    body.close()
            attempt += 1
            await self._backoff(op, attempt, f"GetObject s3://{self.bucket}/{key} [{pos}, {end})", failure, timeouts)

    async def _drain(self, body: Any, chunks: list[bytes], expected: int) -> None:
        got = 0
        while got < expected:
            chunk = await body.read(min(expected - got, MiB))
            if not chunk:
                raise IncompleteReadError(actual_bytes=got, expected_bytes=expected)
            chunks.append(chunk)
            got += len(chunk)
            self._counters.bytes_read += len(chunk)

    @asynccontextmanager
    async def open_read(
        self, key: str, start: int = 0, end: int | None = None, *, etag: str | None = None,
        part_size: int | None = None, read_ahead: int | None = None,
    ) -> AsyncIterator[PartStream]:
        """Read `[start, end)` of `key` as parts, in order, with a sliding window of ranged GETs.

        At most `read_ahead` parts of `part_size` bytes are in flight or waiting to be consumed:
        taking a part starts the next request (the engine's `ReadWindow` over ranged GETs). All
        parts come from one version of the object (the `etag` given, else the first one seen), or
        the read fails. `end=None` costs a HEAD for the size; pass `end` and `etag` from `list()`
        to skip it. Leaving the block early cancels the requests still running.
        """
        part_size = part_size or self.settings.part_size
        read_ahead = read_ahead or self.settings.read_ahead
        if part_size < 1 or read_ahead < 1 or start < 0:
            raise ConfigError(f"open_read needs part_size >= 1, read_ahead >= 1, start >= 0, got "
                              f"{part_size!r}, {read_ahead!r}, {start!r}")
        if end is None:
            info = await self.head(key)
            end, etag = info.size, etag or info.etag
        ranges = [(lo, min(lo + part_size, end)) for lo in range(start, end, part_size)]
        # The window keeps `ahead` parts requested beyond the one being taken; the semaphore makes
        # the one being taken count too, so `read_ahead` bounds the requests (1: one at a time).
        fetch = functools.partial(self._fetch_part, key, _Pin(key, etag), anyio.Semaphore(read_ahead))
        with unwrap_groups():
            async with anyio.create_task_group() as tg:
                yield PartStream(ReadWindow(fetch, ranges, max(read_ahead - 1, 1), tg.start_soon))
                tg.cancel_scope.cancel()

    async def _fetch_part(self, key: str, pin: _Pin, slots: anyio.Semaphore, lo: int, hi: int) -> bytes:
        """Bytes [lo, hi) of `key`, from the object version `pin` holds (b"" past its end)."""
        async with slots, self._operation() as op:
            data, etag = await self._get(op, key, lo, hi, pin.etag)
        pin.check(etag, self.bucket)
        return data

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        """Write `key`. With `if_none_match`, create it only if absent, else raise `AlreadyExists`.

        A conditional or multipart put carries a random id in its metadata
        (`x-amz-meta-zephon-put-id`). When a retry after a lost response meets the put's own
        earlier write (412, or NoSuchUpload for a completed multipart upload), the id on the
        object says the put won; a rival's object, even with the same bytes, still loses it.
        """
        data = bytes(data)
        multipart = len(data) >= self.settings.multipart_threshold
        token = secrets.token_hex(16)
        params: dict[str, Any] = {"Metadata": {_PUT_ID: token}} if if_none_match or multipart else {}
        cond = {"IfNoneMatch": "*"} if if_none_match else {}
        async with self._operation():
            try:
                if multipart:
                    await self._put_multipart(key, data, params, cond)
                else:
                    await self._request("put_object", key, Key=key, Body=data, **params, **cond)
            except ConnectorError as exc:
                if not (params and _code_of(exc) in _OWN_WRITE and await self._written_by(key, token)):
                    raise
        self._counters.bytes_written += len(data)

    async def _written_by(self, key: str, token: str) -> bool:
        try:
            resp = await self._request("head_object", key, Key=key)
        except ObjectNotFound:
            return False
        return resp.get("Metadata", {}).get(_PUT_ID) == token

    async def _put_multipart(
        self, key: str, data: bytes, params: dict[str, Any], cond: dict[str, str]
    ) -> None:
        upload = await self._request("create_multipart_upload", key, Key=key, **params)
        upload_id = upload["UploadId"]
        try:
            parts = await self._upload_parts(key, upload_id, data)
            await self._request("complete_multipart_upload", key, Key=key, UploadId=upload_id,
                                MultipartUpload={"Parts": parts}, **cond)
        except BaseException:
            with anyio.CancelScope(shield=True):
                try:
                    await self._request("abort_multipart_upload", key, Key=key, UploadId=upload_id)
                except ConnectorError as exc:  # the upload already completed, or the server is gone
                    log.debug("abort of multipart upload of s3://%s/%s failed: %s", self.bucket, key, exc)
            raise

    async def _upload_parts(self, key: str, upload_id: str, data: bytes) -> list[dict[str, Any]]:
        size = self.settings.multipart_part_size
        parts: list[dict[str, Any]] = [{} for _ in range(math.ceil(len(data) / size))]
        window = anyio.Semaphore(self.settings.multipart_concurrency)

        async def upload(i: int) -> None:
            async with window:
                resp = await self._request("upload_part", key, Key=key, UploadId=upload_id, PartNumber=i + 1,
                                           Body=data[i * size : (i + 1) * size])
            parts[i] = {"PartNumber": i + 1, "ETag": resp["ETag"]}

        with unwrap_groups():
            async with anyio.create_task_group() as tg:
                for i in range(len(parts)):
                    tg.start_soon(upload, i)
        return parts

    async def delete(self, key: str) -> None:
        await self._request("delete_object", key, Key=key)

    async def copy(self, src_key: str, dst_key: str, *, src_bucket: str | None = None) -> None:
        """Server-side copy (CopyObject): the bytes do not pass through this process.

        `src_bucket` copies from another bucket of the same endpoint, which these credentials
        can read (see `copies_from`)."""
        source = {"Bucket": src_bucket or self.bucket, "Key": src_key}
        await self._request("copy_object", src_key, Key=dst_key, CopySource=source)

    def copies_from(self, source: object) -> bool:
        """Whether `copy_from(source, ...)` works: an S3 store of the same endpoint, region and credentials."""
        return isinstance(source, S3Store) and source._key == self._key

    async def copy_from(self, source: Store, src_key: str, dst_key: str) -> None:
        """Server-side copy of `src_key` in `source`'s bucket to `dst_key` here (`ServerSideCopy`)."""
        if not isinstance(source, S3Store) or not self.copies_from(source):
            raise ConfigError(f"{self!r} cannot copy from {source!r} on the server: give a store of the same "
                              "endpoint, region and credentials, or read and put the object")
        await self.copy(src_key, dst_key, src_bucket=source.bucket)

    def statistics(self) -> StoreStatistics:
        c = self._counters
        return StoreStatistics(requests=c.requests, bytes_read=c.bytes_read, bytes_written=c.bytes_written,
                               retries=c.retries, in_flight=c.in_flight, peak_in_flight=c.peak_in_flight)

    async def aclose(self) -> None:
        if self._own_pool:
            await self._pool.aclose()

    async def __aenter__(self) -> S3Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _settings(settings: S3Settings | None, overrides: dict[str, Any]) -> S3Settings:
    unknown = sorted(set(overrides) - set(S3Settings.__struct_fields__))
    if unknown:
        known = sorted(S3Settings.__struct_fields__)
        raise ConfigError(f"unknown S3 option(s) {unknown}: use one of {known}")
    return msgspec.structs.replace(settings or S3Settings(), **overrides)


def _quoted(etag: str) -> str:
    return '"' + etag.strip('"') + '"'


def _info(key: str, size: int, etag: str) -> ObjectInfo:
    return ObjectInfo(key=key, size=int(size), etag=etag.strip('"'))


def _code_of(exc: BaseException) -> str:
    cause = exc.__cause__
    return _code(cause) if isinstance(cause, ClientError) else ""

