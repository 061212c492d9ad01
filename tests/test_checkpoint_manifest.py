"""The checkpoint manifest is checksummed by every rank in parallel: each rank reads back only the
torch_dist shards it wrote (``__<rank>_<n>.distcp``), rank 0 also the shared files, and the merged
manifest equals the one a single reader computes (and verifies)."""

from __future__ import annotations

import zlib

from megatron_dapo.actor import checkpoint as ckpt

FILES = {
    "__0_0.distcp": b"rank zero shard",
    "__0_1.distcp": b"rank zero second shard",
    "__1_0.distcp": b"rank one shard, longer",
    "__1_1.distcp": b"r1",
    "__3_0.distcp": b"from a 4-rank save",
    ".metadata": b"meta",
    "common.pt": b"common",
    "config.json": b"{}",
    "sub/tokenizer.json": b"{}",
}


def _make(tmp_path):
    for rel, data in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    return tmp_path


def test_each_rank_reads_only_its_own_files(tmp_path, monkeypatch):
    root = _make(tmp_path)
    read = []
    real = ckpt._crc32
    monkeypatch.setattr(ckpt, "_crc32", lambda p: read.append(p.name) or real(p))
    parts = [ckpt.manifest_entries(root, rank, 4) for rank in range(4)]
    assert sorted(read) == sorted(p.split("/")[-1] for p in FILES)  # every file read exactly once
    assert set(parts[1]) == {"__1_0.distcp", "__1_1.distcp"}
    assert set(parts[2]) == set()
    assert set(parts[3]) == {"__3_0.distcp"}
    assert set(parts[0]) == {
        "__0_0.distcp",
        "__0_1.distcp",
        ".metadata",
        "common.pt",
        "config.json",
        "sub/tokenizer.json",
    }


def test_merged_manifest_equals_single_reader_and_verifies(tmp_path):
    root = _make(tmp_path)
    merged = {}
    for rank in range(2):
        merged.update(ckpt.manifest_entries(root, rank, 2))
    for rel, data in FILES.items():  # hand-computed reference
        assert merged[rel] == {"size": len(data), "crc32": zlib.crc32(data)}
    ckpt.write_manifest(root, merged)
    ckpt.verify_checkpoint(root)
    single = ckpt.manifest_entries(root)
    assert single == merged
