"""The driver's SGLang weight transports against a stand-in SGLang server on 127.0.0.1.

The stand-in answers SGLang's weight endpoints and records every call in order. For the NCCL
path it really joins the process group it is told to join (gloo instead of NCCL) and receives
the broadcast tensors, so the test sees what arrived, not only that something was called.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from megatron_dapo.config import ConfigError
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.sync.sglang_transports import (
    EngineEndpoint,
    SGLangDiskTransport,
    SGLangIPCTransport,
    SGLangNCCLTransport,
    resolve_transport_kind,
)

WEIGHT_CALLS = (
    "/pause_generation",
    "/flush_cache",
    "/continue_generation",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
)


class FakeSGLangServer:
    """SGLang's HTTP surface for weight updates; `behaviour` bends it: "ok", "stall_update", "refuse_init"."""

    def __init__(self, behaviour: str = "ok", tp_size: int = 1):
        self.behaviour = behaviour
        self.tp_size = tp_size
        self.calls: list[tuple[str, dict | None]] = []
        self.received: dict[str, tuple[str, list]] = {}
        self.disk_files: list[str] = []
        self.group = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/_log":
                    return self._send(200, fake.log())
                if self.path == "/get_server_info":
                    return self._send(200, {"tp_size": fake.tp_size, "version": "0.5.23"})
                self._send(200, {} if self.path == "/health" else {"status": "ok"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.calls.append((self.path, body))
                code, reply = fake.answer(self.path, body)
                self._send(code, reply)

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, path: str, body: dict | None) -> tuple[int, object]:
        if path == "/init_weights_update_group":
            if self.behaviour == "refuse_init":
                return 400, {"success": False, "message": "bad group"}
            from megatron_dapo.sync.sglang_senders import init_custom_group

            self.group = init_custom_group(
                body["master_address"],
                body["master_port"],
                body["rank_offset"],
                body["world_size"],
                body["group_name"],
                backend=body["backend"],
                timeout_s=20,
            )
            return 200, {"success": True, "message": "joined"}
        if path == "/update_weights_from_distributed":
            if self.behaviour == "stall_update":
                time.sleep(30)  # took the metadata, never joins the broadcast
            from megatron_dapo.sync.sglang_senders import broadcast_bucket

            bucket = {
                name: torch.empty(shape, dtype=getattr(torch, dtype))
                for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"])
            }
            broadcast_bucket(bucket, self.group, timeout_s=20, engine="fake", bucket_index=-1)
            self.received.update({k: (str(v.dtype), v.float().tolist()) for k, v in bucket.items()})
            return 200, {"success": True, "message": "loaded"}
        if path == "/update_weights_from_disk":
            self.disk_files = sorted(os.listdir(body["model_path"]))
            return 200, {"success": True, "message": "reloaded"}
        if path in ("/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update"):
            return 200, {"success": True, "message": "loaded"}
        return 200, {}

    def log(self) -> dict:
        return {"calls": self.calls, "received": self.received, "disk_files": self.disk_files}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _serve_in_child(behaviour: str, conn) -> None:
    torch.set_num_threads(1)
    server = FakeSGLangServer(behaviour)
    conn.send(server.url)
    conn.recv()  # until the test is done


@pytest.fixture
def child_server():
    """A stand-in server in its own process (it joins a gloo group as a separate rank)."""
    started = []

    def start(behaviour: str = "ok") -> str:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve_in_child, args=(behaviour, child), daemon=True)
        proc.start()
        assert parent.poll(60), "stand-in server did not start"
        started.append((proc, parent))
        return parent.recv()

    yield start
    for proc, parent in started:
        parent.send("stop")
        proc.join(2)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def paths(calls) -> list[str]:
    return [p for p, _ in calls if p in WEIGHT_CALLS]


def bucket(fill: float) -> dict[str, torch.Tensor]:
    return {
        "model.layers.0.mlp.up_proj.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) + fill,
        "model.norm.weight": torch.full((3,), fill, dtype=torch.bfloat16),
    }


# ---------------------------------------------------------------- NCCL (on gloo)
def test_nccl_transport_forms_group_broadcasts_each_bucket_and_tags_the_version(child_server):
    url = child_server("ok")
    t = SGLangNCCLTransport(
        [EngineEndpoint("fake-0", url)], timeout_s=20, backend="gloo", master_address="127.0.0.1"
    )
    t.begin(7)
    t.send(0, bucket(1.0))
    t.send(1, {"lm_head.weight": torch.full((2, 2), -3.0)})
    t.finish()
    t.begin(8)  # second sync: the group is reused, not formed again
    t.send(0, bucket(5.0))
    t.finish()
    t.calls.close()
    got = httpx.get(url + "/_log").json()
    calls = got["calls"]
    assert paths(calls) == [
        "/init_weights_update_group",
        "/pause_generation",
        "/flush_cache",
        "/update_weights_from_distributed",
        "/update_weights_from_distributed",
        "/continue_generation",
        "/pause_generation",
        "/flush_cache",
        "/update_weights_from_distributed",
        "/continue_generation",
    ]
    init = calls[0][1]
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, "gloo")
    updates = [b for p, b in calls if p == "/update_weights_from_distributed"]
    assert [u["weight_version"] for u in updates] == ["7", "7", "8"]
    assert updates[0]["names"] == list(bucket(0.0)) and updates[0]["dtypes"] == ["float32", "bfloat16"]
    assert all(u["group_name"] == init["group_name"] for u in updates)
    # what arrived by broadcast is the last value of every tensor, dtype preserved
    for name, ref in {**bucket(5.0), "lm_head.weight": torch.full((2, 2), -3.0)}.items():
        assert got["received"][name] == [str(ref.dtype), ref.float().tolist()]


def test_nccl_transport_times_out_naming_engine_and_bucket(child_server):
    url = child_server("stall_update")
    t = SGLangNCCLTransport(
        [EngineEndpoint("fake-stuck", url)], timeout_s=2, backend="gloo", master_address="127.0.0.1"
    )
    t.begin(1)
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"engine fake-stuck.*bucket 0 \(2 tensors"):
        t.send(0, bucket(1.0))
    # the 2 s deadline ends the wait; the bound is loose so that a loaded machine cannot fail it
    assert time.monotonic() - start < 120


def test_refused_group_surfaces_at_once_naming_the_engine():
    server = FakeSGLangServer("refuse_init")
    try:
        t = SGLangNCCLTransport(
            [EngineEndpoint("fake-refuses", server.url)],
            timeout_s=600,
            backend="gloo",
            master_address="127.0.0.1",
        )
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"engine fake-refuses.*init_weights_update_group.*HTTP 400"):
            t.begin(1)
        assert time.monotonic() - start < 300  # not the 600 s rendezvous deadline
        t.calls.close()
    finally:
        server.close()


# ---------------------------------------------------------------- disk
def test_disk_transport_pause_flush_reload_continue_with_version_and_prunes_old(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen2"}')
    (hf / "tokenizer.json").write_text("{}")
    servers = [FakeSGLangServer(), FakeSGLangServer()]
    try:
        eps = [EngineEndpoint(f"fake-{i}", s.url) for i, s in enumerate(servers)]
        t = SGLangDiskTransport(eps, tmp_path / "sync", timeout_s=10, hf_metadata_dir=hf)
        t.begin(3)
        t.send(0, bucket(1.0))
        t.send(1, {"lm_head.weight": torch.full((2, 2), 4.0)})
        t.finish()
        for s in servers:
            assert paths(s.calls) == [
                "/pause_generation",
                "/flush_cache",
                "/update_weights_from_disk",
                "/continue_generation",
            ]
            reload = dict(s.calls)["/update_weights_from_disk"]
            assert reload["model_path"] == str(tmp_path / "sync" / "v3") and reload["weight_version"] == "3"
            # at reload time the directory was a complete HF checkpoint
            assert s.disk_files == [
                "config.json",
                "model-00000.safetensors",
                "model-00001.safetensors",
                "model.safetensors.index.json",
                "tokenizer.json",
            ]
        loaded = {
            **load_file(str(tmp_path / "sync/v3/model-00000.safetensors")),
            **load_file(str(tmp_path / "sync/v3/model-00001.safetensors")),
        }
        for name, ref in {**bucket(1.0), "lm_head.weight": torch.full((2, 2), 4.0)}.items():
            assert loaded[name].dtype == ref.dtype and torch.equal(loaded[name], ref)
        index = json.loads((tmp_path / "sync/v3/model.safetensors.index.json").read_text())
        assert index["weight_map"]["lm_head.weight"] == "model-00001.safetensors"

        t.begin(4)
        t.send(0, bucket(2.0))
        t.finish()
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v4"]
        assert dict(servers[0].calls[-2:])["/update_weights_from_disk"]["weight_version"] == "4"
        t.calls.close()
    finally:
        for s in servers:
            s.close()


def test_disk_transport_names_the_engine_that_is_gone(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    server = FakeSGLangServer()
    server.close()  # nobody listens there any more
    t = SGLangDiskTransport(
        [EngineEndpoint("fake-gone", server.url)], tmp_path / "s", timeout_s=5, hf_metadata_dir=hf
    )
    t.calls.engines[0].client.backoff_s = 0.01
    t.begin(1)
    t.send(0, bucket(1.0))
    with pytest.raises(EngineError, match=r"weight sync, pause_generation: sglang engine fake-gone"):
        t.finish()
    t.calls.close()


# ---------------------------------------------------------------- CUDA IPC and the choice
def test_ipc_transport_refuses_cpu_buckets_naming_engine_and_bucket():
    server = FakeSGLangServer()
    try:
        t = SGLangIPCTransport([EngineEndpoint("fake-ipc", server.url, tp_size=2)], timeout_s=5)
        t.begin(2)
        with pytest.raises(
            EngineError, match=r"fake-ipc: CUDA IPC needs CUDA tensors and bucket 4 \(2 tensors"
        ):
            t.send(4, bucket(1.0))
        t.finish()
        assert paths(server.calls) == ["/pause_generation", "/flush_cache", "/continue_generation"]
        t.calls.close()
    finally:
        server.close()


def test_transport_choice_by_placement():
    def cfg(transport, placement):
        return OmegaConf.create(
            {"trainer": {"placement": placement, "weight_sync": {"transport": transport}}}
        )

    assert resolve_transport_kind(cfg("auto", "colocated")) == "cuda_ipc"
    assert resolve_transport_kind(cfg("auto", "disaggregated")) == "nccl"
    assert resolve_transport_kind(cfg("disk", "colocated")) == "disk"
    assert resolve_transport_kind(cfg("nccl", "disaggregated")) == "nccl"
    here, there = (
        EngineEndpoint("here", "http://127.0.0.1:30000"),
        EngineEndpoint("there", "http://192.0.2.1:30000"),
    )
    assert resolve_transport_kind(cfg("auto", "colocated"), [here]) == "cuda_ipc"
    # colocated, a server on another node: its handles cannot come from here, and NCCL would put
    # the sender and that engine's TP rank on one GPU in one communicator ("Duplicate GPU detected")
    assert resolve_transport_kind(cfg("auto", "colocated"), [here, there]) == "disk"
    with pytest.raises(ConfigError, match=r"transport=nccl with trainer.placement=colocated.*Duplicate GPU"):
        resolve_transport_kind(cfg("nccl", "colocated"), [here])
    # on CPUs nothing shares a GPU: the distributed update runs over gloo whatever the placement
    assert resolve_transport_kind(cfg("auto", "colocated"), [here], gpus=False) == "nccl"
    assert resolve_transport_kind(cfg("nccl", "colocated"), [here], gpus=False) == "nccl"
    with pytest.raises(ConfigError, match="object_store is for HF engines"):
        resolve_transport_kind(cfg("object_store", "colocated"))


def test_transports_pickle_without_clients():
    """Ray ships the transport to rank 0's actor: it must pickle before and after use."""
    import pickle

    server = FakeSGLangServer()
    try:
        t = SGLangIPCTransport([EngineEndpoint("fake-0", server.url)], timeout_s=5)
        t.begin(1)
        t.finish()
        clone = pickle.loads(pickle.dumps(t))
        assert clone.calls._engines is None and clone.calls.endpoints == t.calls.endpoints
        t.calls.close()
        n = pickle.loads(pickle.dumps(SGLangNCCLTransport([EngineEndpoint("e", server.url)], 5)))
        assert n._group is None
    finally:
        server.close()


# ---------------------------------------------------------------- CUDA IPC from every engine's own ranks
def _fake_serialize(bucket: dict[str, torch.Tensor]) -> str:
    """Stands in for CUDA IPC handles: says which rank (process) made the payload and what it held."""
    import torch.distributed as dist

    sums = {k: float(v.double().sum()) for k, v in bucket.items()}
    return json.dumps({"rank": dist.get_rank(), "pid": os.getpid(), "sums": sums})


def _rank_ipc_sync(rank: int, world: int, urls: list[str]) -> None:
    import torch.distributed as dist

    from megatron_dapo.sync.sglang_transports import EngineEndpoint, SGLangRankIPCTransport

    dist.init_process_group("gloo")
    # engine 0 on the GPUs of ranks 0-1 (node A), engine 1 on those of ranks 2-3 (node B)
    eps = [EngineEndpoint("e0", urls[0], 2, None, (0, 1)), EngineEndpoint("e1", urls[1], 2, None, (2, 3))]
    t = SGLangRankIPCTransport(eps, timeout_s=60, serialize=_fake_serialize)
    t.begin(7)
    for index, fill in enumerate((1.0, 2.0)):
        t.send(index, bucket(fill) if rank == 0 else None)  # only global rank 0 holds the buckets
    t.finish()
    t.calls.close()
    dist.destroy_process_group()


def test_rank_ipc_payloads_come_from_each_engines_own_ranks_one_per_tp_rank():
    from megatron_dapo.actor.spawn import run_ranks

    servers = [FakeSGLangServer(tp_size=2), FakeSGLangServer(tp_size=2)]
    try:
        run_ranks(_rank_ipc_sync, 4, [s.url for s in servers], timeout_s=300)
        expected = [{k: float(v.double().sum()) for k, v in bucket(fill).items()} for fill in (1.0, 2.0)]
        pids = set()
        for engine, server in enumerate(servers):
            assert paths(server.calls) == [
                "/pause_generation",
                "/flush_cache",
                "/update_weights_from_tensor",
                "/update_weights_from_tensor",
                "/continue_generation",
            ]
            updates = [body for p, body in server.calls if p == "/update_weights_from_tensor"]
            for index, body in enumerate(updates):
                assert body["weight_version"] == "7"
                payloads = [json.loads(x) for x in body["serialized_named_tensors"]]
                # TP rank j's payload was made by the trainer rank on its GPU, each by its own process
                assert [p["rank"] for p in payloads] == [2 * engine, 2 * engine + 1]
                assert len({p["pid"] for p in payloads}) == 2
                assert all(p["sums"] == expected[index] for p in payloads)  # the broadcast copy is exact
                pids.update(p["pid"] for p in payloads)
        assert len(pids) == 4
    finally:
        for s in servers:
            s.close()
