"""S3-compatible object stores (AWS S3, MinIO, Ceph, R2, GCS's S3 API) through boto3.

Everything is the standard AWS configuration, read by boto3 itself: the
credential chain (environment, ``AWS_PROFILE`` and the shared files, web
identity / IRSA, instance metadata), ``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` for a store that is not AWS, ``AWS_DEFAULT_REGION``.
Retries with backoff are botocore's (standard mode); a large shard is fetched
with s3transfer's ranged GETs in parallel. Every error names the bucket and
key and says what is wrong: no credentials, access denied, no such bucket or
key, the endpoint unreachable.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..formats.files import create_new
from ..formats.urls import redact, redact_text
from .stores import MAX_LIST_BYTES, StoreContext, StoreError

log = logging.getLogger("feedline.sampler")

SCHEME = "s3://"
AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION",
                 "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE")
PART = 16 << 20  # ranged GETs of this size, in parallel, for shards larger than it
_OURS = __name__.split(".")[0] + "."  # exceptions raised by feedline itself (the installed name)


S3Error = StoreError  # its errors are the stores' (stores.py)


@dataclass(frozen=True)
class S3Object:
    """A key in a bucket, and its size where a listing or HEAD told it."""

    bucket: str
    key: str
    size: int | None = None

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b.tar`` -> (``bucket``, ``a/b.tar``)."""
    rest = url[len(SCHEME):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise S3Error("denied", f"{url} names no bucket (s3://bucket/key)", retry=False)
    return bucket, key


PAGE_COST = 4096  # the bytes a listing's page counts as at least: max_index_bytes bounds the number of pages too


class ListingTooLarge(Exception):
    """A listing's page past what the listing may still read."""

    def __init__(self, nbytes: int):
        super().__init__(f"{nbytes} bytes")
        self.bytes = nbytes


class S3Client:
    """One boto3 client (thread-safe) and a transfer configuration for every shard of a sidecar."""

    def __init__(self, connect_timeout: float = 10.0, read_timeout: float = 30.0, retries: int = 3,
                 threads: int = 4, max_list_bytes: int = MAX_LIST_BYTES):
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError:
            raise S3Error("denied", "s3:// sources need boto3 (pip install boto3; the image has it)",
                          retry=False) from None
        for name in AWS_VARIABLES:  # compose's ${AWS_REGION:-} gives "": that means unset, not a region named ""
            if os.environ.get(name) == "":
                del os.environ[name]
        config = Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                        retries={"max_attempts": retries + 1, "mode": "standard"},
                        max_pool_connections=max(10, threads * (threads + 1)))  # threads x ranged GETs
        self._client = boto3.session.Session().client("s3", config=config)
        self._transfer = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=threads,
                                        use_threads=True)
        self.endpoint = self._client.meta.endpoint_url
        # a listing is the store's own index of a prefix: its pages are read within max_index_bytes, in all
        self.max_list_bytes = max_list_bytes
        self._listing = threading.local()  # the bytes a list() in progress on this thread may still read
        self._client.meta.events.register("before-send.s3.ListObjectsV2", self._bounded_page)

    def _bounded_page(self, request: Any, **_: Any) -> Any:
        """Send a listing's page request and read its answer within what the listing may still take (botocore
        would read a page whole, however large a store makes it); every page costs at least ``PAGE_COST``, so
        the pages are bounded too, and a store that never stops listing stops being read."""
        left = getattr(self._listing, "left", None)
        if left is None:
            return None  # not a list() of ours: botocore sends it
        request.stream_output = True  # else the session reads the whole body itself, before a byte is counted
        response = self._client._endpoint.http_session.send(request)
        declared = int(response.headers.get("content-length") or 0)
        if declared > left:
            response.raw.close()
            raise ListingTooLarge(declared)
        chunks, got = [], 0
        for chunk in response.raw.stream(1 << 16):
            got += len(chunk)
            if got > left:
                response.raw.close()
                raise ListingTooLarge(got)
            chunks.append(chunk)
        response._content = b"".join(chunks)  # what AWSResponse.content would have read
        self._listing.left = left - max(got, PAGE_COST)
        return response

    # -- errors ---------------------------------------------------------------------------------------

    def _explain(self, exc: BaseException, what: str) -> S3Error:
        """``exc`` as a person can act on it; ``what`` (a URL) and anything of the exception's text that quotes
        one are redacted (a presigned endpoint, a user in it: ``formats.urls.redact``)."""
        from botocore.exceptions import (
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
            ReadTimeoutError,
        )

        what, endpoint, said = redact_text(what), redact(self.endpoint or ""), redact_text(str(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return S3Error("no_space", f"{what}: the cache filesystem is full ({exc.strerror}); it is tried again "
                                       f"later", retry=False)
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return S3Error("denied", f"{what}: no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                     f"(a Kubernetes Secret), AWS_PROFILE, or give the pod an IAM role",
                           retry=False)
        if isinstance(exc, EndpointConnectionError):
            return S3Error("connection", f"{what}: the endpoint {endpoint} is unreachable ({said}); set "
                                         f"AWS_ENDPOINT_URL for a store that is not AWS", retry=True)
        if isinstance(exc, (ConnectTimeoutError, ReadTimeoutError)):
            return S3Error("timeout", f"{what}: {said}", retry=True)
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in ("NoSuchBucket",):
                return S3Error("http_status", f"{what}: no such bucket at {endpoint}", retry=False)
            if code in ("NoSuchKey", "404", "NotFound"):
                return S3Error("http_status", f"{what}: no such key", retry=False)
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
                return S3Error("denied", f"{what}: access denied ({code}): check the credentials and the bucket "
                                         f"policy", retry=False)
            return S3Error("http_status", f"{what}: {code or status} {said}",
                           retry=status >= 500 or status == 429)
        return S3Error("connection", f"{what}: {type(exc).__name__}: {said}", retry=True)

    # -- requests -----------------------------------------------------------------------------------

    def list(self, url: str) -> list[S3Object]:
        """Every object under a prefix (``s3://bucket/prefix/``), with its size; the listing's pages read within
        ``max_list_bytes`` (``max_index_bytes``) in all, each counted as ``PAGE_COST`` at least."""
        bucket, prefix = split(url)
        out: list[S3Object] = []
        pages = 0
        self._listing.left = self.max_list_bytes
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                pages += 1
                out.extend(S3Object(bucket, o["Key"], int(o["Size"])) for o in page.get("Contents", []))
        except ListingTooLarge as exc:
            raise S3Error("too_large", f"listing {redact(url)}: its pages passed max_index_bytes={self.max_list_bytes} "
                                       f"bytes after {pages} page(s) and {len(out)} objects (a page of {exc.bytes} "
                                       f"bytes, each counted as {PAGE_COST} at least): list a narrower prefix, give an "
                                       f"index file, or raise max_index_bytes (--max-index-bytes / "
                                       f"FEEDLINE_MAX_INDEX_BYTES) if the bucket really holds that many shards",
                          retry=False) from None
        except Exception as exc:
            raise self._explain(exc, f"listing {url}") from None
        finally:
            self._listing.left = None
        return out

    def size(self, url: str) -> int:
        bucket, key = split(url)
        try:
            return int(self._client.head_object(Bucket=bucket, Key=key)["ContentLength"])
        except Exception as exc:
            error = self._explain(exc, url)
        if "no such key" in str(error):  # a HEAD answers 404 alone: is it the key or the whole bucket?
            try:
                self._client.head_bucket(Bucket=bucket)
            except Exception as exc:
                code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
                if code in ("404", "NoSuchBucket"):
                    error = S3Error("http_status", f"s3://{bucket}: no such bucket at {redact(self.endpoint or '')}",
                                    retry=False)
        raise error

    def text(self, url: str, max_bytes: int) -> str:
        """An object's text (an index), at most ``max_bytes`` of it: one larger, announced or streamed, is an
        S3Error ``too_large`` and no more of it is read."""
        bucket, key = split(url)
        try:
            obj = self._client.get_object(Bucket=bucket, Key=key)
        except Exception as exc:
            raise self._explain(exc, url) from None
        body = obj["Body"]
        try:
            if int(obj.get("ContentLength") or 0) > max_bytes:
                raise S3Error("too_large", f"{redact(url)}: {obj['ContentLength']} bytes, over {max_bytes}",
                              retry=False)
            data = body.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise S3Error("too_large", f"{redact(url)}: over {max_bytes} bytes", retry=False)
            return data.decode()
        except S3Error:
            raise
        except Exception as exc:
            raise self._explain(exc, url) from None
        finally:
            body.close()

    def download(self, url: str, dest: str, progress: Callable[[int], None]) -> int:
        """Fetch an object into ``dest`` (ranged, parallel GETs when large); ``progress(bytes)`` may raise to stop.

        Returns the bytes written.
        """
        bucket, key = split(url)
        written = 0
        lock = threading.Lock()

        def callback(n: int) -> None:  # called from s3transfer's threads
            nonlocal written
            with lock:
                written += n
            progress(n)

        try:
            with create_new(dest) as f:  # never a file that was there, never through a link
                self._client.download_fileobj(bucket, key, f, Config=self._transfer, Callback=callback)
        except Exception as exc:
            if type(exc).__module__.startswith(_OURS):  # the progress callback's own (a stop, a budget)
                raise
            raise self._explain(exc, url) from None
        return written

    @property
    def client(self) -> Any:
        return self._client


def open_store(context: StoreContext) -> S3Client:
    """The ``s3://`` store of a fetcher (``stores.Stores``)."""
    return S3Client(read_timeout=context.timeout, retries=context.retries, threads=context.threads,
                    max_list_bytes=context.max_list_bytes)
