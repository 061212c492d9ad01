"""MoE rollout routing replay with SGLang engines: what the driver asks of the servers and clients,
and a 1-step training run whose actor replays the experts an SGLang-shaped server returned.

SGLang 0.5.23's contract, read from its source (nothing here imports it):
- server flag ``--enable-return-routed-experts`` (``ServerArgs.enable_return_routed_experts``);
  without it no ``RoutedExpertsCapturer`` exists and replies carry no ``routed_experts``;
- request fields ``return_routed_experts`` and ``routed_experts_start_len`` (``GenerateReqInput``);
- reply ``meta_info.routed_experts``: base64 of the int32 host-cache rows of positions
  ``[routed_experts_start_len, seq_len - 1)``, each ``[num_hidden_layers, num_experts_per_tok]``
  (``state_capturer/routed_experts.py``, ``base.py``; ``detokenizer_manager._b64_encode_per_request``).

The real CPU server cannot start with that flag (the capturer pins its host cache with
``cudaHostRegister``: "Torch not compiled with CUDA enabled"), so the run uses ``SGLangMoEStandIn``:
the test suite's SGLang stand-in (``test_sglang_driver_transport.FakeSGLangServer``) answering
``/generate`` from transformers' ``Qwen3MoeForCausalLM`` and its router's top-k, encoded as above.
That encoding is this file's reading of SGLang's layout, the parser's too; so the parser is also
checked against a reply SGLang's own code encoded (``tests/fixtures/sglang/routed_experts_reply.json``).
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from e2e_harness import REPO, read_metrics, train_overrides
from helpers import random_hf_model, tiny_hf_config
from omegaconf import OmegaConf
from test_sglang_driver_transport import FakeSGLangServer

from megatron_dapo.config import ConfigError, load_config, to_container

LAYERS, TOP_K = 2, 2  # tiny_hf_config("qwen3_moe"): 8 experts, top-2


class SGLangMoEStandIn(FakeSGLangServer):
    """SGLang's HTTP surface with ``/generate`` served by an HF Qwen3-MoE: sampled tokens with
    their log-probs and, when asked, every forwarded position's routed experts as SGLang 0.5.23
    encodes them; ``/update_weights_from_disk`` reloads the model. ``routed=False`` plays a server
    started without the flag (no ``routed_experts`` in its replies)."""

    def __init__(self, model_path, routed: bool = True):
        self.routed = routed
        self.lock = threading.Lock()
        self.generate_bodies: list[dict] = []
        self._load(model_path)
        self.version = None
        super().__init__()

    def _load(self, path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def answer(self, path, body):
        if path == "/generate":
            with self.lock:
                self.generate_bodies.append(body)
                return 200, self._generate(body)
        if path == "/update_weights_from_disk":
            with self.lock:
                self._load(body["model_path"])
                self.version = body["weight_version"]
        return super().answer(path, body)

    @torch.no_grad()
    def _generate(self, body: dict) -> dict:
        s = body["sampling_params"]
        if s.get("top_p", 1.0) < 1.0 or s.get("top_k", -1) > 0:
            raise ValueError("the stand-in samples the full distribution only")
        gen = torch.Generator().manual_seed(int(s.get("sampling_seed", 0)))
        stops = set(s.get("stop_token_ids") or [])
        if not s.get("ignore_eos"):
            stops.add(self.model.config.eos_token_id)
        ids, out = list(body["input_ids"]), []
        for _ in range(s["max_new_tokens"]):
            logits = self.model(torch.tensor([ids])).logits[0, -1].double()
            logp = torch.log_softmax(logits / s["temperature"], -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            ids.append(token)
            out.append([float(logp[token]), token, None])
            if token in stops:
                break
        meta = {
            "finish_reason": {"type": "stop" if out[-1][1] in stops else "length"},
            "output_token_logprobs": out,
            "weight_version": self.version,
        }
        if self.routed and body.get("return_routed_experts"):
            start = body.get("routed_experts_start_len", 0)
            forwarded = torch.tensor([ids[:-1]])  # the last sampled token is never forwarded
            router = self.model(forwarded, output_router_logits=True).router_logits  # per layer [T, E]
            experts = torch.stack([r.topk(TOP_K, dim=-1).indices for r in router], dim=1)[start:]
            meta["routed_experts"] = base64.b64encode(experts.to(torch.int32).numpy().tobytes()).decode()
        return {"text": "", "output_ids": [t for _, t, _ in out], "meta_info": meta}


def _cfg(model_path, **overrides):
    args = [f"model.path={model_path}", "actor.routing_replay=rollout"]
    cfg = load_config(None, args + [f"{k}={v}" for k, v in overrides.items()])
    return OmegaConf.create(to_container(cfg))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "hf"
    random_hf_model(tiny_hf_config("qwen3_moe", num_layers=LAYERS), 7).save_pretrained(str(path))
    return path


def test_routed_experts_shape_is_read_from_the_hf_config(moe_dir, tmp_path):
    from megatron_dapo.sglang.engines import routed_experts_shape

    assert routed_experts_shape(_cfg(moe_dir)) == (LAYERS, TOP_K)
    assert routed_experts_shape(_cfg(moe_dir, **{"actor.routing_replay": "none"})) is None
    dense = tmp_path / "dense"
    tiny_hf_config("qwen3").save_pretrained(str(dense))
    with pytest.raises(ConfigError, match=r"actor.routing_replay=rollout needs a mixture-of-experts model"):
        routed_experts_shape(_cfg(dense))
    sparse = tiny_hf_config("qwen3_moe", num_layers=3)
    sparse.mlp_only_layers = [1]
    sparse.save_pretrained(str(tmp_path / "sparse"))
    with pytest.raises(ConfigError, match=r"dense layers \(decoder_sparse_step=1, mlp_only_layers=\[1\]\)"):
        routed_experts_shape(_cfg(tmp_path / "sparse"))


def test_every_server_and_client_the_driver_makes_gets_the_flag_and_shape(moe_dir, tmp_path, monkeypatch):
    """Launched here (torchrun/no-Ray), launched per node (Ray), connected by URL, and a torchrun
    peer's server connected by rank 0: flag on the servers, (layers, top-k) on every client."""
    from megatron_dapo.sglang import engines as sglang_engines
    from megatron_dapo.sglang import torchrun as sglang_torchrun
    from megatron_dapo.sglang.placement import EnginePlan
    from megatron_dapo.sglang.server import ROUTED_EXPERTS_FLAG, build_launch_command

    fake = SGLangMoEStandIn(moe_dir)
    cfg = _cfg(moe_dir)
    configs = [sglang_engines.server_config(cfg, 0, (), tmp_path, port=fake.url.rsplit(":", 1)[1], cpu=True)]
    assert configs[0].return_routed_experts and ROUTED_EXPERTS_FLAG in build_launch_command(configs[0])
    off = sglang_engines.server_config(_cfg(moe_dir, **{"actor.routing_replay": "none"}), 0, (), tmp_path)
    assert ROUTED_EXPERTS_FLAG not in build_launch_command(off)

    class Started:  # a launched server whose process is the stand-in already listening
        def __init__(self, c):
            self.cfg = c

        def start(self):
            return self

        def wait_healthy(self):
            pass

        def stop(self):
            pass

        url = property(lambda self: self.cfg.url)
        name = "standin"

    monkeypatch.setattr(sglang_engines, "SGLangServer", Started)
    monkeypatch.setattr(
        sglang_engines, "launch_on_nodes", lambda plans, cs, **kw: (None, [Started(c) for c in cs])
    )
    plan = EnginePlan(0, "node", "127.0.0.1", (), int(fake.url.rsplit(":", 1)[1]))
    engines = []
    try:
        engines += sglang_engines.launch_sglang_engines(cfg, configs)
        engines += sglang_engines.launch_planned_engines(cfg, [plan], tmp_path, cpu=True)
        engines += sglang_engines.start_sglang_engines(
            _cfg(moe_dir, **{"rollout.sglang.urls": f"[{fake.url}]"})
        )
        servers = sglang_torchrun.NodeServers([plan], [fake.url], {})
        engines += sglang_torchrun.rank0_engines(cfg, servers)
        assert len(engines) == 4
        assert [e.client.routed_experts_shape for e in engines] == [(LAYERS, TOP_K)] * 4
    finally:
        sglang_engines.stop_sglang_engines(engines)
        fake.close()


def test_url_given_server_without_the_flag_is_named_in_the_error(moe_dir):
    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
    from megatron_dapo.sglang.client import SGLangError
    from megatron_dapo.sglang.engines import start_sglang_engines, stop_sglang_engines

    fake = SGLangMoEStandIn(moe_dir, routed=False)
    try:
        (engine,) = start_sglang_engines(_cfg(moe_dir, **{"rollout.sglang.urls": f"[{fake.url}]"}))
        try:
            req = GenerationRequest("r0", [5, 6, 7], SamplingParams(max_new_tokens=2, seed=1))
            with pytest.raises(
                SGLangError,
                match=r"has no meta_info.routed_experts, which actor.routing_replay=rollout needs: the server "
                r"must be started with --enable-return-routed-experts .*rollout.sglang.urls",
            ):
                engine.generate([req])
        finally:
            stop_sglang_engines([engine])
    finally:
        fake.close()


def test_sglang_experts_in_their_source_layout_parse_per_forwarded_token(moe_dir):
    """The reply built as SGLang's capturer + detokenizer build it (rows [start, seq_len - 1), each
    [num_hidden_layers, k], int32, base64) parses to those rows with the driver's shape."""
    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
    from megatron_dapo.sglang.client import parse_generate_reply
    from megatron_dapo.sglang.engines import routed_experts_shape

    fake = SGLangMoEStandIn(moe_dir)
    try:
        req = GenerationRequest("r0", [5, 6, 7, 8], SamplingParams(max_new_tokens=5, seed=3, ignore_eos=True))
        from megatron_dapo.sglang.client import payload_generate

        reply = fake._generate(payload_generate(req, routed_experts=True))
    finally:
        fake.close()
    res = parse_generate_reply(reply, req, "sglang-0", routed_experts_shape(_cfg(moe_dir)))
    ids = req.prompt_ids + res.output_ids
    assert res.routed_experts.shape == (len(ids) - 1, LAYERS, TOP_K)
    with torch.no_grad():
        logits = fake.model(torch.tensor([ids[:-1]]), output_router_logits=True).router_logits
    for layer in range(LAYERS):
        want = logits[layer].topk(TOP_K, dim=-1).indices
        assert torch.equal(res.routed_experts[:, layer].long(), want), layer


def test_parser_reads_the_experts_sglang_itself_encoded(tmp_path):
    """A reply whose ``routed_experts`` SGLang 0.5.23's own capturer, scheduler and detokenizer
    encoded (tests/fixtures/sglang/routed_experts_reply.py: a 5-token prompt, 4 sampled tokens,
    3 layers, top-4 of 256 experts, KV slots shared with a batched second request) parses to the
    experts each forwarded position routed to. The stand-in above encodes from the parser's own
    reading of SGLang's layout; these bytes do not."""
    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
    from megatron_dapo.sglang.client import parse_generate_reply, payload_generate
    from megatron_dapo.sglang.engines import routed_experts_shape

    fixtures = Path(__file__).parent / "fixtures" / "sglang"
    fixture = json.loads((fixtures / "routed_experts_reply.json").read_text())
    wheel = json.loads((fixtures / "wheel.json").read_text())
    assert fixture["sglang"] == wheel["version"], "regenerate the fixture with the pinned SGLang"
    sent = fixture["request"]
    req = GenerationRequest(sent["rid"], sent["input_ids"], SamplingParams(**sent["sampling_params"]))
    asked = payload_generate(req, routed_experts=True)
    assert {k: asked[k] for k in ("return_routed_experts", "routed_experts_start_len")} == {
        k: sent[k] for k in ("return_routed_experts", "routed_experts_start_len")
    }, "the fixture's request is not the one the client sends"
    model = fixture["model"]
    config = tiny_hf_config("qwen3_moe", num_layers=model["num_hidden_layers"])
    config.num_experts, config.num_experts_per_tok = model["num_experts"], model["num_experts_per_tok"]
    config.save_pretrained(str(tmp_path / "hf"))
    res = parse_generate_reply(fixture["reply"], req, "sglang-0", routed_experts_shape(_cfg(tmp_path / "hf")))
    assert res.output_ids == fixture["reply"]["output_ids"]
    want = torch.tensor(fixture["routed_by_position"])
    assert want.shape == (len(req.prompt_ids) + len(res.output_ids) - 1, 3, 4)
    assert torch.equal(res.routed_experts.long(), want), (
        "parsed experts are not the positions' routed experts"
    )


def _moe_demo_assets(root: Path) -> SimpleNamespace:
    """The demo's task and tokenizer with a random tiny Qwen3-MoE (no warm start: one step only
    needs the routing, not the rewards)."""
    from megatron_dapo.demo.model import TinyModelSpec, save_checkpoint
    from megatron_dapo.demo.task import make_problems, to_rows, write_parquet
    from megatron_dapo.demo.tokenizer import build_tokenizer

    spec = TinyModelSpec()
    train, val = make_problems(0, 64, 8)
    write_parquet(to_rows(train, "train"), root / "train.parquet")
    write_parquet(to_rows(val, "test"), root / "val.parquet")
    tokenizer = build_tokenizer(spec.vocab_size)
    config = tiny_hf_config("qwen3_moe", num_layers=LAYERS, vocab=spec.vocab_size)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    save_checkpoint(random_hf_model(config, 11), tokenizer, root / "hf")
    return SimpleNamespace(
        hf_dir=root / "hf", train_file=root / "train.parquet", val_file=root / "val.parquet"
    )


def test_a_driver_step_replays_the_experts_the_sglang_server_returned(tmp_path):
    """engine=sglang (a server given by URL), routing_replay=rollout, one rank, 1 step: every
    /generate asked for the experts from position 0, the actor replayed them (it refuses a batch
    without them) and its routers agree with them on every response token: 0 mismatch, which a
    shifted token or a swapped layer would break."""
    from megatron_dapo.driver.launch import load_for_cli, run_train

    assets = _moe_demo_assets(tmp_path / "assets")
    server = SGLangMoEStandIn(assets.hf_dir)
    try:
        over = {
            "rollout.engine": "sglang",
            "rollout.sglang.urls": f"[{server.url}]",
            "trainer.weight_sync.transport": "disk",
            "actor.routing_replay": "rollout",
            "parallel.tensor_model_parallel_size": 1,
            "parallel.expert_model_parallel_size": 1,
            "parallel.actor_world_size": 1,
            "trainer.val_before_train": "false",
            "trainer.test_freq": 0,
            "trainer.save_freq": 0,
            "logging.plots_at_end": "false",
            # not this test's subject (and a run at EP=2 sat in it for minutes here)
            "trainer.hf_export_at_end": "false",
        }
        args = train_overrides(assets, tmp_path / "runs", "moe_replay", 1, **over)
        summary = run_train(load_for_cli(str(REPO / "configs/demo.yaml"), args))
    finally:
        server.close()
    (step,) = [r for r in read_metrics(Path(summary["run_dir"])) if r["step"] >= 1]
    assert step["actor/routing_mismatch"] == 0.0
    assert step["actor/rollout_logprob_abs_diff"] < 1e-4  # the trainer scores what the server served
    bodies = server.generate_bodies
    assert len(bodies) >= 16 and all(
        b["return_routed_experts"] and b["routed_experts_start_len"] == 0 for b in bodies
    )
