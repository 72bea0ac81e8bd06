"""What an S3 tier's prefix holds, found by listing: committed steps, stored files, trash markers,
and what an interrupted upload left behind.

Every function here reads (ListObjectsV2, ListMultipartUploads, HeadObject) and changes nothing; the
key layout is :class:`ckptflow.storage.s3_tier.S3Tier`'s (``<prefix>/<run>/step-<N>/<path>``), passed
in as the key prefixes it has already checked. A listing is one paginated request per 1,000 keys, so
the pipeline learns what is stored without a HEAD per object.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime

from ckptflow.storage.manifest import MANIFEST_NAME
from ckptflow.storage.posix_tier import TRASH_MARK
from ckptflow.storage.s3_client import S3Bucket

_STEP_PREFIX = re.compile(r"step-(\d+)/$")


@dataclass(frozen=True)
class IncompleteUpload:
    """A multipart upload not completed nor aborted; ``run`` None for a key outside any step."""

    key: str
    upload_id: str
    initiated: datetime
    run: str | None
    step: int


def committed_steps(s3: S3Bucket, run_prefix: str, max_concurrency: int) -> list[int]:
    """The steps under ``run_prefix`` (``<prefix>/<run>/``) whose manifest object exists, newest
    first: a ``step-N/`` without its manifest is an upload still going or interrupted, not a step."""
    candidates = []
    for item in s3.paginate("list_objects_v2", "CommonPrefixes", Prefix=run_prefix, Delimiter="/"):
        match = _STEP_PREFIX.search(item["Prefix"])
        if match and item["Prefix"] == f"{run_prefix}step-{match.group(1)}/":
            candidates.append(int(match.group(1)))
    with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
        heads = list(pool.map(lambda s: s3.head(f"{run_prefix}step-{s}/{MANIFEST_NAME}"), candidates))
    return sorted((s for s, head in zip(candidates, heads, strict=True) if head), reverse=True)


def stored_sizes(s3: S3Bucket, step_prefix: str) -> dict[str, int]:
    """Path (relative to ``step_prefix``) -> size of every object stored under it."""
    return {
        item["Key"][len(step_prefix) :]: int(item["Size"])
        for item in s3.paginate("list_objects_v2", "Contents", Prefix=step_prefix)
    }


def trash_markers(s3: S3Bucket, step_prefix: str) -> list[str]:
    """The keys of the step's trash markers (``manifest.json.trash-<ts>``), oldest first."""
    prefix = step_prefix + MANIFEST_NAME + TRASH_MARK
    return sorted(o["Key"] for o in s3.paginate("list_objects_v2", "Contents", Prefix=prefix))


def leftover_objects(s3: S3Bucket, step_prefix: str) -> list[tuple[str, int, datetime]]:
    """(key, size, last modified) of the objects under ``step_prefix`` when it has neither a manifest
    nor a trash marker; empty when the step is committed or soft-deleted."""
    listed = s3.paginate("list_objects_v2", "Contents", Prefix=step_prefix)
    objects = [(o["Key"], int(o["Size"]), o["LastModified"]) for o in listed]
    names = {key[len(step_prefix) :] for key, _, _ in objects}
    if MANIFEST_NAME in names or any(n.startswith(MANIFEST_NAME + TRASH_MARK) for n in names):
        return []
    return objects


def incomplete_uploads(s3: S3Bucket, tier_prefix: str) -> list[IncompleteUpload]:
    """Every multipart upload under ``tier_prefix`` (the tier's prefix, "" for the whole bucket) not
    yet completed or aborted, with the run and step its key belongs to."""
    prefix = f"{tier_prefix}/" if tier_prefix else ""
    found = []
    for upload in list(s3.paginate("list_multipart_uploads", "Uploads", Prefix=prefix)):
        match = re.match(re.escape(prefix) + r"([^/]+)/step-(\d+)/", upload["Key"])
        run, step = (match.group(1), int(match.group(2))) if match else (None, -1)
        found.append(IncompleteUpload(upload["Key"], upload["UploadId"], upload["Initiated"], run, step))
    return found
