"""Layouts of fused Megatron weights vs hand-built references, and the safetensors reader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_dapo.weights.hf_io import CheckpointError, SafetensorsReader, ShardedSafetensorsWriter
from megatron_dapo.weights.layout import MERGERS, READERS, DictSource, Dims

DIMS = Dims(num_heads=8, num_kv_heads=2, head_dim=3, vocab_size=10, padded_vocab_size=16)


def _qkv_reference(q, k, v, dims: Dims) -> torch.Tensor:
    """Megatron's linear_qkv row order written out head by head."""
    qpg, hd = dims.num_heads // dims.num_kv_heads, dims.head_dim
    rows = []
    for g in range(dims.num_kv_heads):
        for h in range(g * qpg, (g + 1) * qpg):
            rows.append(q[h * hd : (h + 1) * hd])
        rows.append(k[g * hd : (g + 1) * hd])
        rows.append(v[g * hd : (g + 1) * hd])
    return torch.cat(rows)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_interleave_per_query_group(tp, bias):
    gen = torch.Generator().manual_seed(0)
    tail = () if bias else (5,)
    q = torch.randn((DIMS.num_heads * DIMS.head_dim, *tail), generator=gen)
    k = torch.randn((DIMS.num_kv_heads * DIMS.head_dim, *tail), generator=gen)
    v = torch.randn((DIMS.num_kv_heads * DIMS.head_dim, *tail), generator=gen)
    src = DictSource({"q": q, "k": k, "v": v})
    shards = [READERS["qkv"](src, ("q", "k", "v"), tp, r, DIMS) for r in range(tp)]
    assert torch.equal(torch.cat(shards), _qkv_reference(q, k, v, DIMS))
    back = MERGERS["qkv"](shards, DIMS)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_gate_up_is_stacked_per_tp_shard():
    gate = torch.arange(8.0).reshape(4, 2)
    up = 100 + torch.arange(8.0).reshape(4, 2)
    src = DictSource({"g": gate, "u": up})
    s0, s1 = (READERS["gate_up"](src, ("g", "u"), 2, r, DIMS) for r in range(2))
    assert torch.equal(s0, torch.cat([gate[:2], up[:2]]))
    assert torch.equal(s1, torch.cat([gate[2:], up[2:]]))
    g, u = MERGERS["gate_up"]([s0, s1], DIMS)
    assert torch.equal(g, gate) and torch.equal(u, up)


def test_vocab_padding_rows_are_zero_and_dropped_on_merge():
    emb = torch.randn(10, 4)
    src = DictSource({"e": emb})
    shards = [READERS["vocab"](src, ("e",), 2, r, DIMS) for r in range(2)]
    assert [s.shape[0] for s in shards] == [8, 8]
    assert torch.equal(shards[0], emb[:8])
    assert torch.equal(shards[1][:2], emb[8:]) and not shards[1][2:].any()
    assert torch.equal(MERGERS["vocab"](shards, DIMS)[0], emb)


def test_vocab_rows_must_match_config():
    with pytest.raises(ValueError, match="vocab_size is 10"):
        READERS["vocab"](DictSource({"e": torch.zeros(12, 4)}), ("e",), 1, 0, DIMS)


def test_row_split_and_indivisible_error():
    w = torch.randn(3, 6)
    src = DictSource({"w": w})
    assert torch.equal(READERS["row"](src, ("w",), 2, 1, DIMS), w[:, 3:])
    with pytest.raises(ValueError, match="not divisible by tensor parallel size 4"):
        READERS["row"](src, ("w",), 4, 0, DIMS)


def test_reader_slices_sharded_checkpoint_and_writer_index(tmp_path):
    tensors = {f"t{i}": torch.randn(4, 6) for i in range(3)}
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=4 * 6 * 4 * 2)
    writer.add(tensors)
    files = writer.close()
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    reader = SafetensorsReader(tmp_path)
    assert reader.shape("t2") == (4, 6) and reader.dtype("t2") == torch.float32
    assert torch.equal(reader.slice("t2", 1, 2, 5), tensors["t2"][:, 2:5])
    assert torch.equal(reader.slice("t0", 0, 1, 3), tensors["t0"][1:3])
    with pytest.raises(CheckpointError, match="'nope' not found"):
        reader.shape("nope")


def test_reader_names_missing_and_corrupt_files(tmp_path):
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        SafetensorsReader(tmp_path)
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is listed"):
        SafetensorsReader(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    reader = SafetensorsReader(tmp_path)
    with pytest.raises(CheckpointError, match="corrupt or unreadable safetensors file .*00002-of-00002"):
        reader.shape("b")
