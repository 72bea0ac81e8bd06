"""One S3 bucket at one endpoint: credentials, a lazily built boto3 client, and errors that say where.

Every boto/network failure becomes a ``TierError`` naming the endpoint, the bucket and the key,
never the secret key. Short connect/read timeouts and bounded retries make a dead endpoint fail in
seconds instead of hanging a transfer. boto3 is imported only when the first request is made.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptflow.storage.manifest import FileEntry
from ckptflow.storage.tier import TierConfigurationError, TierError
from ckptflow.storage.verify import FileProblem

CREDENTIAL_ERRORS = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "InvalidClientTokenId"}
)
NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})


@dataclass(frozen=True)
class S3Credentials:
    """An access key pair; its repr never shows the secret."""

    access_key_id: str
    secret_access_key: str = field(repr=False)

    def __repr__(self) -> str:
        return f"S3Credentials(access_key_id={self.access_key_id!r}, secret_access_key='***')"

    @classmethod
    def from_env(
        cls, prefix: str = "CKPTFLOW_S3_", environ: Mapping[str, str] | None = None
    ) -> S3Credentials | None:
        """``<prefix>ACCESS_KEY_ID`` and ``<prefix>SECRET_ACCESS_KEY``, or None (the AWS chain applies)."""
        env = os.environ if environ is None else environ
        key, secret = env.get(prefix + "ACCESS_KEY_ID"), env.get(prefix + "SECRET_ACCESS_KEY")
        return cls(key, secret) if key and secret else None


def error_code(exc: BaseException) -> str:
    """The S3 error code behind a TierError raised by :meth:`S3Bucket.call` ('' if none)."""
    cause = exc.__cause__ if isinstance(exc, TierError) else exc
    response = getattr(cause, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def stored_problem(head: dict[str, Any] | None, entry: FileEntry) -> FileProblem | None:
    """Compare a HeadObject (checksum mode on) with a manifest entry: size, CRC64NVME, FULL_OBJECT."""
    if head is None:
        return FileProblem(entry.path, "missing", "no such object")
    if head.get("ContentLength") != entry.size:
        return FileProblem(
            entry.path, "size", f"{head.get('ContentLength')} bytes, manifest says {entry.size}"
        )
    # SeaweedFS omits ChecksumType for single PutObjects; a CRC64NVME is full-object by definition.
    stored, kind = head.get("ChecksumCRC64NVME"), head.get("ChecksumType", "FULL_OBJECT")
    if stored != entry.checksum or kind != "FULL_OBJECT":
        detail = f"stored crc64nvme {stored} ({kind}), manifest says {entry.checksum}"
        return FileProblem(entry.path, "checksum", detail)
    return None


class S3Bucket:
    """A bucket reached through one thread-safe boto3 client, built on first use."""

    def __init__(
        self,
        owner: str,
        bucket: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        credentials: S3Credentials | None = None,
        max_connections: int = 16,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        max_attempts: int = 3,
        wrap_client: Callable[[Any], Any] | None = None,
    ) -> None:
        self.owner = owner  # the tier's name, first word of every error
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.region = region
        self._credentials = credentials
        self._settings = (max_connections, connect_timeout_s, read_timeout_s, max_attempts)
        self._wrap_client = wrap_client  # fault injection in tests: wraps the real client
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return self.endpoint_url or f"AWS S3 ({self.region or 'default region'})"

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                connections, connect, read, attempts = self._settings
                config = Config(
                    connect_timeout=connect,
                    read_timeout=read,
                    retries={"max_attempts": attempts, "mode": "standard"},
                    max_pool_connections=connections,
                    # We send and check CRC64NVME ourselves: no extra CRC32, no double validation
                    # (and none of a full-object checksum against a ranged GET's bytes).
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    s3={"addressing_style": "path"} if self.endpoint_url else None,
                )
                creds = self._credentials
                session = boto3.session.Session()  # a private session: the default one is not thread-safe
                client = session.client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    region_name=self.region or ("us-east-1" if self.endpoint_url else None),
                    aws_access_key_id=creds.access_key_id if creds else None,
                    aws_secret_access_key=creds.secret_access_key if creds else None,
                    config=config,
                )
                self._client = self._wrap_client(client) if self._wrap_client else client
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None and hasattr(self._client, "close"):
                self._client.close()
            self._client = None

    def error(self, exc: BaseException, action: str, key: str | None = None) -> TierError:
        """A TierError naming endpoint, bucket and key, never the secret; a TierConfigurationError
        for a request refused for good (credentials rejected, access denied, no such bucket)."""
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        where = f"s3://{self.bucket}/{key}" if key else f"bucket {self.bucket!r}"
        kind = TierError
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code, message = err.get("Code", "?"), err.get("Message", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            # A rejected HEAD has no body, hence no code: a bare 403 is all the server says.
            if code in CREDENTIAL_ERRORS or (status == 403 and code in ("403", "Forbidden")):
                text = (
                    f"{self.owner}: the credentials were rejected by {self.endpoint} for bucket "
                    f"{self.bucket!r} ({code}: {message or 'forbidden'}) during {action} {where}; "
                    "check the access key id and secret"
                )
                kind = TierConfigurationError
            elif code == "AccessDenied":
                text = (
                    f"{self.owner}: access denied by {self.endpoint} for bucket {self.bucket!r} during "
                    f"{action} {where}: the credentials are valid but lack permission ({message})"
                )
                kind = TierConfigurationError
            elif code == "NoSuchBucket":
                text = f"{self.owner}: bucket {self.bucket!r} does not exist at {self.endpoint} ({action})"
                kind = TierConfigurationError
            else:
                text = f"{self.owner}: {action} {where} at {self.endpoint} failed: {code}: {message}"
        elif isinstance(exc, NoCredentialsError):
            text = (
                f"{self.owner}: no S3 credentials for bucket {self.bucket!r} at {self.endpoint}; pass "
                "S3Credentials, set CKPTFLOW_S3_ACCESS_KEY_ID/CKPTFLOW_S3_SECRET_ACCESS_KEY or configure AWS"
            )
        elif isinstance(exc, EndpointConnectionError):
            text = f"{self.owner}: cannot reach {self.endpoint} for bucket {self.bucket!r} ({action} {where})"
        else:
            text = f"{self.owner}: {action} {where} at {self.endpoint} failed: {type(exc).__name__}: {exc}"
        if self._credentials and self._credentials.secret_access_key:
            text = text.replace(self._credentials.secret_access_key, "***")
        return kind(text)

    def call(self, op: str, key: str | None = None, **kwargs: Any) -> Any:
        """``client.<op>(Bucket=..., Key=key, **kwargs)``; any failure as a TierError."""
        from botocore.exceptions import BotoCoreError, ClientError

        if key is not None:
            kwargs["Key"] = key
        try:
            return getattr(self.client(), op)(Bucket=self.bucket, **kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise self.error(exc, op, key) from exc

    def head(self, key: str) -> dict[str, Any] | None:
        """HeadObject with the stored checksum, or None if there is no such object."""
        try:
            return self.call("head_object", key, ChecksumMode="ENABLED")
        except TierError as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise

    def get_bytes(self, key: str) -> tuple[bytes, str | None] | None:
        """(object bytes, stored CRC64NVME) or None if there is no such object."""
        from botocore.exceptions import BotoCoreError

        try:
            response = self.call("get_object", key, ChecksumMode="ENABLED")
        except TierError as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise
        try:
            return response["Body"].read(), response.get("ChecksumCRC64NVME")
        except BotoCoreError as exc:
            raise self.error(exc, "get_object", key) from exc

    def paginate(self, op: str, result_key: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """Every item under ``result_key`` across all pages of a listing."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in self.client().get_paginator(op).paginate(Bucket=self.bucket, **kwargs):
                yield from page.get(result_key) or []
        except (BotoCoreError, ClientError) as exc:
            raise self.error(exc, op, kwargs.get("Key", kwargs.get("Prefix"))) from exc

    def abort(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload; one already gone is fine."""
        try:
            self.call("abort_multipart_upload", key, UploadId=upload_id)
        except TierError as exc:
            if error_code(exc) not in ("NoSuchUpload", *NOT_FOUND):
                raise
