"""CRC64NVME: known answers, incremental and combined forms, the S3 encoding, the checksumming writer."""

from __future__ import annotations

import base64
import io
import os
import random

import pytest

from ckptflow.storage import checksums
from ckptflow.storage.checksums import ChecksummingWriter

# The CRC-64/NVME check value from the CRC catalogue (and the NVMe spec): crc of b"123456789".
CHECK_VALUE = 0xAE8B14860A799888


def _payload(n: int, seed: int = 7) -> bytes:
    return random.Random(seed).randbytes(n)


def test_known_answer_123456789():
    assert checksums.crc64nvme(b"123456789") == CHECK_VALUE


def test_known_answer_in_s3_form():
    # S3 sends the 8 checksum bytes big-endian, base64-encoded.
    expected = base64.b64encode(bytes.fromhex("AE8B14860A799888")).decode()
    assert checksums.checksum_bytes(b"123456789") == expected == "rosUhgp5mIg="


def test_empty_input_is_zero():
    assert checksums.crc64nvme(b"") == 0
    assert checksums.checksum_bytes(b"") == "AAAAAAAAAAA="


def test_one_bit_changes_the_checksum():
    data = bytearray(_payload(4096))
    before = checksums.crc64nvme(data)
    data[1234] ^= 0x10
    assert checksums.crc64nvme(data) != before


@pytest.mark.parametrize("split", [0, 1, 4, 9])
def test_continuing_from_previous_equals_one_shot(split):
    data = b"123456789"
    first = checksums.crc64nvme(data[:split])
    assert checksums.crc64nvme(data[split:], first) == CHECK_VALUE


def test_accepts_bytearray_and_memoryview():
    data = _payload(1000)
    expected = checksums.crc64nvme(data)
    assert checksums.crc64nvme(bytearray(data)) == expected
    assert checksums.crc64nvme(memoryview(data)) == expected


def test_encode_decode_round_trip():
    for value in (0, 1, CHECK_VALUE, 2**64 - 1):
        text = checksums.encode(value)
        assert len(text) == 12
        assert checksums.decode(text) == value
        assert checksums.is_well_formed(text)


@pytest.mark.parametrize(
    "text",
    ["not base64!", base64.b64encode(b"1234567").decode(), base64.b64encode(b"123456789").decode(), ""],
)
def test_decode_rejects_malformed(text):
    with pytest.raises(ValueError, match="checksum"):
        checksums.decode(text)
    assert not checksums.is_well_formed(text)


@pytest.mark.parametrize("value", [None, 12, b"rosUhgp5mIg="])
def test_is_well_formed_rejects_non_strings(value):
    assert not checksums.is_well_formed(value)


def test_checksum_file_and_stream_match_in_memory(tmp_path):
    data = _payload(100_003)
    path = tmp_path / "blob"
    path.write_bytes(data)
    expected = checksums.checksum_bytes(data)
    assert checksums.checksum_file(path) == (expected, len(data))
    # A chunk much smaller than the data and not dividing it: every chunk boundary is exercised.
    assert checksums.checksum_file(path, chunk=4096) == (expected, len(data))
    assert checksums.checksum_stream(io.BytesIO(data), chunk=7) == (expected, len(data))


def test_checksum_file_of_empty_file(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    assert checksums.checksum_file(path) == ("AAAAAAAAAAA=", 0)


def test_checksum_file_missing_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        checksums.checksum_file(tmp_path / "nope")


def test_combine_parts_equals_whole():
    data = _payload(10_000)
    cuts = [0, 1, 333, 4096, 4097, 9999, 10_000]
    parts = [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    pairs = [(checksums.crc64nvme(p), len(p)) for p in parts]
    assert checksums.combine(pairs) == checksums.crc64nvme(data)
    assert checksums.combine([]) == 0
    assert checksums.combine([(CHECK_VALUE, 9)]) == CHECK_VALUE


def test_combine_is_order_sensitive():
    a, b = b"12345", b"6789"
    good = checksums.combine([(checksums.crc64nvme(a), len(a)), (checksums.crc64nvme(b), len(b))])
    swapped = checksums.combine([(checksums.crc64nvme(b), len(b)), (checksums.crc64nvme(a), len(a))])
    assert good == CHECK_VALUE
    assert swapped != CHECK_VALUE


# --- ChecksummingWriter ---------------------------------------------------------------------------


def test_writer_checksum_matches_the_bytes_on_disk(tmp_path):
    path = tmp_path / "shard"
    chunks = [_payload(n, seed=n) for n in (1, 4095, 65536, 17)]
    with open(path, "wb") as raw:
        writer = ChecksummingWriter(raw)
        for i, chunk in enumerate(chunks):
            # bytes, bytearray and memoryview: all three arrive from DCP's writer.
            data = chunk if i % 3 == 0 else bytearray(chunk) if i % 3 == 1 else memoryview(chunk)
            assert writer.write(data) == len(chunk)
        assert writer.tell() == sum(map(len, chunks)) == writer.size
        writer.close()
    assert writer.checksum() == checksums.checksum_file(path)[0]
    assert writer.crc == checksums.crc64nvme(path.read_bytes())
    assert path.read_bytes() == b"".join(chunks)


def test_writer_counts_bytes_not_elements_of_typed_buffers(tmp_path):
    import array

    values = array.array("d", [1.5, -2.25, 3.0, 1e300])  # 8-byte items: 32 bytes, 4 elements
    path = tmp_path / "typed"
    with open(path, "wb") as raw:
        writer = ChecksummingWriter(raw)
        assert writer.write(memoryview(values)) == 32
        writer.close()
    assert writer.size == 32 == path.stat().st_size
    assert writer.checksum() == checksums.checksum_bytes(values.tobytes())


def test_writer_keeps_fileno_for_fsync(tmp_path):
    path = tmp_path / "synced"
    with open(path, "wb") as raw:
        writer = ChecksummingWriter(raw)
        writer.write(b"123456789")
        writer.flush()
        assert writer.fileno() == raw.fileno()
        os.fsync(writer.fileno())
        writer.close()
    assert writer.crc == CHECK_VALUE
    assert writer.writable() and not writer.seekable()


class _ShortWrites(io.RawIOBase):
    """A raw stream that accepts only half of each write (as a full disk or a pipe can)."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data):
        n = max(1, len(data) // 2)
        self.taken += bytes(data[:n])
        return n


def test_writer_refuses_a_short_write():
    writer = ChecksummingWriter(_ShortWrites())  # type: ignore[arg-type]
    with pytest.raises(OSError, match="short write"):
        writer.write(b"123456789")
    # The checksum never describes bytes that did not reach the file.
    assert writer.size == 0 and writer.crc == 0


def test_writer_close_is_idempotent_and_flushes(tmp_path):
    path = tmp_path / "buffered"
    raw = open(path, "wb")  # noqa: SIM115 - closed below, through the writer's owner
    writer = ChecksummingWriter(raw)
    writer.write(b"123456789")
    writer.close()
    writer.close()
    assert path.read_bytes() == b"123456789"  # flushed by close, though raw is still open
    raw.close()


def test_thread_buffer_is_reused_per_thread_and_private_to_it():
    import threading

    first = checksums.thread_buffer()
    assert len(first) == checksums.READ_CHUNK
    assert checksums.thread_buffer().obj is first.obj  # same memory: no allocation per file
    assert len(checksums.thread_buffer(4096)) == 4096
    bigger = checksums.thread_buffer(checksums.READ_CHUNK * 2)
    assert len(bigger) == checksums.READ_CHUNK * 2
    other: list[object] = []
    worker = threading.Thread(target=lambda: other.append(checksums.thread_buffer().obj))
    worker.start()
    worker.join()
    assert other[0] is not bigger.obj


def test_checksums_of_many_files_on_many_threads_are_right(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(7)
    blobs = [rng.randbytes(rng.randrange(0, 3 * checksums.READ_CHUNK)) for _ in range(24)]
    for i, blob in enumerate(blobs):
        (tmp_path / f"f{i}").write_bytes(blob)
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda i: checksums.checksum_file(tmp_path / f"f{i}"), range(len(blobs))))
    assert got == [(checksums.checksum_bytes(b), len(b)) for b in blobs]


def test_range_crc_from_prefix_crcs_equals_the_span_crc():
    rng = random.Random(3)
    data = bytes(rng.randrange(256) for _ in range(5000))
    for a, b in [(0, 5000), (0, 1), (17, 4000), (4999, 5000), (1234, 1234)]:
        got = checksums.range_crc(checksums.crc64nvme(data[:a]), checksums.crc64nvme(data[:b]), b - a)
        assert got == checksums.crc64nvme(data[a:b]), (a, b)


def test_writer_block_checksums_cover_spans_between_write_boundaries(tmp_path):
    pieces = [os.urandom(n) for n in (100, 1, 4096, 0, 33)]
    with open(tmp_path / "f", "wb") as raw:
        writer = ChecksummingWriter(raw)
        offsets = []
        for piece in pieces:
            offsets.append(writer.tell())
            writer.write(piece)
        data = b"".join(pieces)
        for i, start in enumerate(offsets):
            for j in range(i, len(pieces)):
                end = offsets[j] + len(pieces[j])
                assert writer.block_checksum(start, end - start) == checksums.checksum_bytes(data[start:end])
        with pytest.raises(ValueError, match="write boundaries"):
            writer.block_checksum(50, 10)  # 50 is inside the first write


def test_copy_with_spans_reads_once_and_gives_every_span_its_crc():
    rng = random.Random(7)
    for _ in range(200):
        data = rng.randbytes(rng.randint(0, 3000))
        spans = []
        for _ in range(rng.randint(0, 5)):
            offset = rng.randint(0, len(data))
            spans.append((offset, rng.randint(0, len(data) - offset)))
        copied = io.BytesIO()
        whole, size, blocks = checksums.copy_with_spans(
            io.BytesIO(data), copied, spans, chunk=rng.choice([1, 5, 64, 1 << 20])
        )
        assert (whole, size, copied.getvalue()) == (checksums.checksum_bytes(data), len(data), data)
        assert blocks == {(o, n): checksums.checksum_bytes(data[o : o + n]) for o, n in spans}


def test_copy_with_spans_refuses_a_span_past_the_end():
    with pytest.raises(ValueError, match=r"span \[2, \+9\) ends past the end of the 4-byte file"):
        checksums.copy_with_spans(io.BytesIO(b"abcd"), None, [(0, 2), (2, 9)])
