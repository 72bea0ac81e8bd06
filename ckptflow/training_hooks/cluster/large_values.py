"""Values larger than one store value may be: split into chunks, behind a small marker.

A c10d ``TCPStore`` server refuses a value over 8 MiB (torch 2.13: "Invalid payload size", and the
client's connection drops), and a save's decision carries the checkpoint's manifest and ``.metadata``:
about 64 ranks x 1,000 items already pass it. So a body over :data:`MAX_VALUE` is stored as chunks
under ``<key>.chunks/<i>`` and the key itself holds a marker naming their count, total size and
CRC64NVME; a reader of the marker waits (bounded) for the chunks, joins and verifies them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ckptflow.storage import checksums

MAX_VALUE = 4 << 20  # well under the server's 8 MiB limit
MARKER = "ckptflow.chunked"


@dataclass(frozen=True)
class Chunked:
    """What a marker says: the body is ``count`` chunks, ``size`` bytes in all, with this CRC."""

    count: int
    size: int
    crc: str

    def to_bytes(self) -> bytes:
        return json.dumps({MARKER: {"count": self.count, "size": self.size, "crc": self.crc}}).encode()


def chunk_key(key: str, index: int) -> str:
    return f"{key}.chunks/{index}"


def split(data: bytes) -> tuple[Chunked, list[bytes]] | None:
    """The marker and chunks of ``data``, or None if it fits in one value."""
    if len(data) <= MAX_VALUE:
        return None
    chunks = [data[i : i + MAX_VALUE] for i in range(0, len(data), MAX_VALUE)]
    return Chunked(len(chunks), len(data), checksums.checksum_bytes(data)), chunks


def marker_of(value: bytes) -> Chunked | None:
    """The marker ``value`` is, or None (an ordinary body). Cheap on large bodies: a marker is
    small and starts with its one key."""
    if len(value) > 256 or not value.startswith(b'{"' + MARKER.encode()):
        return None
    raw = json.loads(value)[MARKER]
    return Chunked(int(raw["count"]), int(raw["size"]), str(raw["crc"]))


def join(marker: Chunked, chunks: list[bytes], key: str) -> bytes:
    """The body the chunks make, verified against the marker (a ``ValueError`` naming ``key``)."""
    data = b"".join(chunks)
    crc = checksums.checksum_bytes(data)
    if len(data) != marker.size or crc != marker.crc:
        raise ValueError(
            f"{key}: the chunks joined make {len(data)} bytes with crc64nvme {crc}, "
            f"the marker says {marker.size} with {marker.crc}"
        )
    return data
