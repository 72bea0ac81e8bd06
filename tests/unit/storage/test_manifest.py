"""The manifest: round trip, strict parsing, unsafe paths, unsupported versions, reading from disk."""

from __future__ import annotations

import json
import math

import pytest

from ckptflow.storage import checksums
from ckptflow.storage.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Alternate,
    FileEntry,
    Manifest,
    ManifestError,
    NodePart,
    UnsupportedManifestError,
    content_digest,
    finite_metrics,
    manifest_checksum,
    parse_manifest,
    read_manifest,
    safe_relative_path,
)

GOOD_CRC = checksums.checksum_bytes(b"123456789")


def _manifest(**overrides) -> Manifest:
    fields = {
        "run": "demo",
        "step": 40,
        "world_size": 2,
        "save_id": "abcd1234-40",
        "files": (
            FileEntry("__0_0.distcp", 9, GOOD_CRC, 0),
            FileEntry("__1_0.distcp", 0, checksums.checksum_bytes(b""), 1),
            FileEntry(".metadata", 5, checksums.checksum_bytes(b"meta!"), 0),
        ),
        "metrics": {"loss": 0.25},
        "versions": {"torch": "2.13.0"},
        "created_at": "2026-01-02T03:04:05Z",
        "stats": {"stage_s": 0.01},
    }
    fields.update(overrides)
    return Manifest(**fields)


def _body(**overrides) -> dict:
    """A manifest's JSON without its digest (the field checks below change it; the digest has its
    own tests)."""
    body = json.loads(_manifest().to_json())
    del body["digest"]
    body.update(overrides)
    return body


def _parse(body: dict) -> Manifest:
    return parse_manifest(json.dumps(body).encode(), where="/ckpt/step-40/manifest.json")


def test_round_trip():
    original = _manifest()
    assert parse_manifest(original.to_json()) == original
    assert original.total_bytes == 14
    assert original.format_version == FORMAT_VERSION == 2


def test_to_json_is_strict_json():
    with pytest.raises(ValueError):
        _manifest(metrics={"loss": math.nan}).to_json()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "not a ckptflow manifest"),
        (json.dumps({"format": "something.else", "format_version": 1}).encode(), "not a ckptflow manifest"),
    ],
)
def test_garbage_is_a_manifest_error_naming_the_source(data, match):
    with pytest.raises(ManifestError, match=match) as info:
        parse_manifest(data, where="/ckpt/step-7/manifest.json")
    assert "/ckpt/step-7/manifest.json" in str(info.value)
    assert not isinstance(info.value, UnsupportedManifestError)


def test_unsupported_version_is_its_own_error():
    with pytest.raises(UnsupportedManifestError, match="format_version 99") as info:
        _parse(_body(format_version=99))
    assert "/ckpt/step-40/manifest.json" in str(info.value)
    assert isinstance(info.value, ManifestError)  # callers catching ManifestError still stop


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("format_version", True, "format_version"),  # bool is not an int here
        ("format_version", "1", "format_version"),
        ("step", -1, "step must be >= 0"),
        ("step", 1.5, "'step'"),
        ("world_size", 0, "world_size >= 1"),
        ("run", 3, "'run'"),
        ("save_id", None, "'save_id'"),
        ("files", {}, "'files'"),
        ("checksum_algorithm", "crc32c", "crc32c"),
        ("metrics", [1, 2], "metrics"),
    ],
)
def test_bad_fields(field, value, match):
    with pytest.raises(ManifestError, match=match):
        _parse(_body(**{field: value}))


@pytest.mark.parametrize("field", ["format_version", "step", "world_size", "run", "save_id", "files"])
def test_missing_required_field(field):
    body = _body()
    del body[field]
    with pytest.raises(ManifestError, match=f"missing field '{field}'"):
        _parse(body)


def _with_file(**entry) -> dict:
    body = _body()
    body["files"][0].update(entry)
    return body


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"size": -1}, "size must be >= 0"),
        ({"size": "9"}, "'size'"),
        ({"checksum": "abc"}, "not a base64 CRC64NVME"),
        ({"checksum": checksums.encode(1)[:-4]}, "not a base64 CRC64NVME"),
        ({"path": "__1_0.distcp"}, "duplicate path"),
        ({"path": MANIFEST_NAME}, "cannot list itself"),
    ],
)
def test_bad_file_entries(entry, match):
    with pytest.raises(ManifestError, match=match) as info:
        _parse(_with_file(**entry))
    # The entry is named: files[0] itself, or for a duplicate the later entry that repeats it.
    assert "files[0]" in str(info.value) or "files[1]: duplicate" in str(info.value)


def test_file_entry_not_an_object():
    body = _body()
    body["files"][1] = "__1_0.distcp"
    with pytest.raises(ManifestError, match=r"files\[1\]: expected an object"):
        _parse(body)


@pytest.mark.parametrize(
    "path",
    [
        "../escape",
        "/etc/passwd",
        "a/../../b",
        "sub/../x",
        "a//b",
        "a/",
        "./..",
        "..",
        "a\\..\\b",
        "",
        None,
        7,
    ],
)
def test_paths_outside_the_directory_are_refused(path):
    with pytest.raises(ManifestError):
        _parse(_with_file(path=path))
    with pytest.raises(ManifestError):
        safe_relative_path(path, "here")


@pytest.mark.parametrize("path", ["__0_0.distcp", ".hidden", "rank0/shard.bin", "a.b/c..d"])
def test_plain_relative_paths_are_accepted(path):
    assert safe_relative_path(path, "here") == path
    assert _parse(_with_file(path=path)).files[0].path == path


def test_non_numeric_metrics_are_dropped_on_parse():
    parsed = _parse(_body(metrics={"loss": 1, "lr": 0.5, "note": "text", "flag": None}))
    assert parsed.metrics == {"loss": 1.0, "lr": 0.5}


def test_finite_metrics():
    assert finite_metrics({"loss": 2, "acc": 0.5, "bad": math.inf, "nan": math.nan}) == {
        "loss": 2.0,
        "acc": 0.5,
    }
    assert finite_metrics(None) == {}
    with pytest.raises(ValueError, match="'name'"):
        finite_metrics({"name": "resnet"})


def test_read_manifest_from_disk(tmp_path):
    original = _manifest()
    (tmp_path / MANIFEST_NAME).write_bytes(original.to_json())
    assert read_manifest(tmp_path) == original
    assert manifest_checksum(tmp_path) == checksums.checksum_bytes(original.to_json())


def test_read_manifest_missing_names_the_path(tmp_path):
    with pytest.raises(ManifestError, match="no manifest") as info:
        read_manifest(tmp_path / "step-3")
    assert str(tmp_path / "step-3" / MANIFEST_NAME) in str(info.value)


def test_read_manifest_unreadable_names_the_path(tmp_path):
    (tmp_path / MANIFEST_NAME).mkdir()  # reading a directory fails with an OSError
    with pytest.raises(ManifestError, match="cannot read manifest") as info:
        read_manifest(tmp_path)
    assert str(tmp_path / MANIFEST_NAME) in str(info.value)


def test_read_manifest_unsupported_version_names_the_path(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(_body(format_version=3)))
    with pytest.raises(UnsupportedManifestError) as info:
        read_manifest(tmp_path)
    assert str(tmp_path / MANIFEST_NAME) in str(info.value)


def test_parsing_the_same_bytes_again_reuses_the_validated_manifest():
    data = _manifest().to_json()
    first = parse_manifest(data, where="/a/manifest.json")
    assert parse_manifest(bytearray(data), where="/a/manifest.json") is first  # no second validation
    # Another tier's copy of the same checkpoint holds the same bytes: not validated again either.
    assert parse_manifest(data, where="/warm/b/manifest.json") is first


def test_errors_are_not_cached_and_name_each_source():
    bad = json.dumps(_body(step=-1)).encode()
    for where in ("/a/manifest.json", "/a/manifest.json", "/b/manifest.json"):
        with pytest.raises(ManifestError, match="step must be >= 0") as info:
            parse_manifest(bad, where=where)
        assert where in str(info.value)


# --- format 2: nodes, blocks, alternates ----------------------------------------------------------


def _two_node_manifest() -> Manifest:
    data = b"0123456789abcdef"
    blocks = ((0, 10, checksums.checksum_bytes(data[:10])), (10, 6, checksums.checksum_bytes(data[10:])))
    return _manifest(
        files=(
            FileEntry("__0_0.distcp", 16, checksums.checksum_bytes(data), 0, 0, blocks),
            FileEntry("__2_0.distcp", 16, checksums.checksum_bytes(data), 2, 1, blocks),
            FileEntry(".metadata", 5, checksums.checksum_bytes(b"meta!"), 0, 0),
        ),
        world_size=4,
        nodes=(NodePart(0, "node0", (0, 1)), NodePart(1, "node1", (2, 3))),
        alternates=(Alternate("app.model.bias", (0,), "__2_0.distcp", 10, 6),),
    )


def test_format_2_round_trips_nodes_blocks_and_alternates():
    original = _two_node_manifest()
    parsed = parse_manifest(original.to_json())
    assert parsed == original
    assert parsed.entry("__2_0.distcp").block(10, 6) == original.files[1].blocks[1][2]
    assert parsed.entry("__2_0.distcp").block(0, 6) is None
    assert [f.path for f in parsed.part_files(1)] == ["__2_0.distcp"]
    assert parsed.part_bytes(0) == 21


def test_format_1_manifests_still_parse():
    body = _body(format_version=1)
    for f in body["files"]:
        f.pop("node", None)
    body.pop("nodes", None)
    body.pop("alternates", None)
    parsed = _parse(body)
    assert parsed.format_version == 1
    assert parsed.nodes == () and all(f.node == 0 and f.blocks == () for f in parsed.files)
    assert b'"nodes"' not in parsed.to_json()  # written back as what it is


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b["files"][0].update(blocks=[[0, 99, GOOD_CRC]]), r"files\[0\]: blocks\[0\]"),
        (lambda b: b["files"][0].update(blocks=[[0, 1, "nope"]]), r"blocks\[0\] must be"),
        (lambda b: b["files"][0].update(node=-1), "'node' must be an integer"),
        (lambda b: b.update(nodes=[{"node": 0, "host": "a", "ranks": ["x"]}]), r"nodes\[0\]: field 'ranks'"),
        (
            lambda b: b.update(
                alternates=[{"fqn": "w", "offset": None, "file": "gone", "file_offset": 0, "length": 1}]
            ),
            r"alternates\[0\]: 'gone'",
        ),
    ],
)
def test_format_2_fields_are_validated(mutate, match):
    body = json.loads(_two_node_manifest().to_json())
    mutate(body)
    body["digest"] = content_digest(body)  # sealed again: the field itself must be refused
    with pytest.raises(ManifestError, match=match) as info:
        _parse(body)
    assert "/ckpt/step-40/manifest.json" in str(info.value)


# --- the manifest's own digest -------------------------------------------------------------------


def test_to_json_writes_a_digest_of_the_content():
    body = json.loads(_manifest().to_json())
    assert checksums.is_well_formed(body["digest"])
    assert body["digest"] == content_digest(body)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"loss": 0.25', b'"loss": 0.35'),  # one digit of a metric
        (b'"step": 40', b'"step": 41'),
        (b'"run": "demo"', b'"run": "dema"'),
        (b'"size": 9', b'"size": 8'),
        (b'"world_size": 2', b'"world_size": 1'),
    ],
)
def test_a_changed_digit_is_refused(old, new):
    data = _manifest().to_json()
    assert old in data
    with pytest.raises(ManifestError, match="changed after it was written") as info:
        parse_manifest(data.replace(old, new), where="/ckpt/step-40/manifest.json")
    assert "/ckpt/step-40/manifest.json" in str(info.value)


def test_the_digest_covers_content_not_whitespace():
    original = _manifest()
    compact = json.dumps(json.loads(original.to_json()), separators=(",", ":")).encode()
    assert parse_manifest(compact) == original


@pytest.mark.parametrize("digest", ["", "zz", 7, None])
def test_a_malformed_digest_is_refused(digest):
    with pytest.raises(ManifestError, match="'digest'"):
        _parse({**json.loads(_manifest().to_json()), "digest": digest})


def test_manifests_without_a_digest_still_parse():
    # Written by ckptflow before the field existed (format 2), and format 1.
    body = json.loads(_manifest().to_json())
    del body["digest"]
    assert _parse(body) == _manifest()
    old = json.loads(_manifest(format_version=1).to_json())
    del old["digest"]
    assert _parse(old).format_version == 1
