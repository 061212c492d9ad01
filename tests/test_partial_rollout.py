"""Partial rollouts (``rollout.partial``): an interrupted generation continued later equals the
uninterrupted one (HF engine, greedy, same weights under a new version) with per-token versions
across the sync; the over-sampling tail is carried to the next rollout and continued there
(counts by hand); the carried state survives a checkpoint; SGLang's aborted reply keeps its
tokens and per-token versions as SGLang's source defines them."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from helpers import tiny_hf_config
from rollout_fakes import MIXED, Dataset, Scorer, ScriptedEngine, Tokenizer, accounted, manager_config

from megatron_dapo.actor.checkpoint import MANIFEST, CheckpointError, verify_checkpoint, write_manifest
from megatron_dapo.driver.run_state import CARRIED_FILE, read_carried
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.manager import RolloutManager
from megatron_dapo.rollout.partial import carry_from_items, carry_to_state, continuation, from_result, join
from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
from megatron_dapo.sglang.client import parse_generate_reply, payload_generate

torch.set_num_threads(1)


def _tiny_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_hf_config(vocab=128, hidden=32, heads=4, kv_heads=2), dtype=torch.float32
    )
    with torch.no_grad():  # far from uniform, so greedy picks are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model.eval()


def _reference_logprobs(model, prompt, output):
    """log_softmax of each output token from one unpadded full-sequence forward (T=1, greedy)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def test_hf_generation_stopped_at_a_sync_and_continued_equals_the_uninterrupted_one():
    model = _tiny_model()
    engine = HFEngine(model=model)
    reqs = [
        GenerationRequest(
            f"r{i}", [5 + i] * (2 + 3 * i), SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        )
        for i in range(3)
    ]
    whole = engine.generate(reqs)

    # stop every request after exactly 4 tokens: the abort lands during the 3rd decode step (a
    # prefill draws each row's first token, each step one more), and the engine checks it before
    # the next step
    steps = []

    def abort_at_third_step(_module, args, kwargs, _out):
        steps.append(kwargs["input_ids"].shape[1] == 1)
        if sum(steps) == 3:
            engine.abort()

    hook = model.register_forward_hook(abort_at_third_step, with_kwargs=True)
    stopped = engine.generate(reqs)
    hook.remove()
    assert [(len(r.output_ids), r.finish_reason) for r in stopped] == [(4, "abort")] * 3

    # a weight sync to version 1 with the same weights, then the continuation
    engine.load_weights([dict(model.state_dict())], version=1)
    kept = [from_result(r, None) for r in stopped]
    rest = engine.generate(
        [continuation(q.request_id, q.prompt_ids, k, q.sampling) for q, k in zip(reqs, kept)]
    )
    for q, w, k, r in zip(reqs, whole, kept, rest):
        joined = join(k, r)
        assert len(r.output_ids) == 8 and r.finish_reason == "length"  # the remaining budget only
        assert joined.output_ids == w.output_ids
        # the same numbers up to float rounding (prefill of prompt + 4 tokens vs 4 cached decode
        # steps), and both match an independent full-sequence forward
        torch.testing.assert_close(torch.tensor(joined.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
        ref = _reference_logprobs(model, q.prompt_ids, w.output_ids)
        torch.testing.assert_close(torch.tensor(joined.logprobs), ref, rtol=0, atol=1e-5)
        assert joined.token_versions == [0] * 4 + [1] * 8
        assert joined.finish_reason == "length"


def _carrying_manager(engine, **kw):
    # 6 prompts per round, 2 groups needed; one group per call, all 6 calls dispatched at once
    cfg = manager_config(train_batch_size=2, gen_batch_size=6, partial=True, **kw)
    return RolloutManager([engine], Scorer(), cfg, Tokenizer())


def test_over_sampling_tail_is_continued_by_the_next_rollout_not_discarded():
    # prompts 0, 1 answer at once (both mixed: the batch is full); 2..5 generate 2 of their 3
    # tokens and block until the tail abort, which returns those 2 tokens
    engine = ScriptedEngine("e0", slow_prompts=range(2, 6), keep_on_abort=2, slow_once=True)
    mgr = _carrying_manager(engine)
    data = Dataset([MIXED])
    first = mgr.collect(data, weight_version=3)
    m = first.metrics
    assert [s.prompt.index for s in first.samples[::4]] == [0, 1]
    assert m["rollout/surplus"] == 0 and m["rollout/aborted"] == 0 and m["rollout/unused"] == 0
    assert m["rollout/partial_groups_carried"] == 4  # prompts 2..5
    assert m["rollout/partial_tokens_carried"] == 4 * 4 * 2  # 4 groups x n=4 x 2 tokens
    assert m["rollout/prompts_drawn"] == 6 and accounted(m) + 4 == 6

    # the weights move to version 4; nothing blocks now
    engine.version = 4
    before = len(engine.requests)
    second = mgr.collect(data, weight_version=4)
    m = second.metrics
    # the carried groups come first in draw order: the batch is prompts 2 and 3, continued
    assert [s.prompt.index for s in second.samples[::4]] == [2, 3]
    assert m["rollout/partial_groups_resumed"] == 4
    assert m["rollout/prompts_drawn"] == 2  # 6 per round, 4 of them carried: prompts 6, 7 are new
    assert m["rollout/groups_in_batch"] == 2 and m["rollout/partial_groups_carried"] == 4  # 4, 5, 6, 7
    assert accounted(m) + m["rollout/partial_groups_carried"] == m["rollout/prompts_drawn"] + 4
    for j, s in enumerate(second.samples):
        right = j % 2 == 0  # the scripted answer of a mixed prompt: even samples right
        assert s.response_ids == [1 if right else 2, 5, 5]
        assert s.acc == right and s.finish_reason == "stop"
        assert s.rollout_logprobs == [-0.5] * 3
        assert s.token_versions == [3, 3, 4] and s.interrupted == 1
    assert m["rollout/partial_sample_fraction"] == 1.0
    # every continued response was scored as the engine handed it over, on the joined tokens (a
    # reward of the continuation alone would differ from the call's and be scored again)
    assert m["reward/early_fraction"] == 1.0
    assert m["rollout/tokens_version_lag_1"] == 8 * 2 and m["rollout/tokens_version_lag_0"] == 8
    # the continuations sent prompt + the 2 kept tokens, with the remaining budget (8 - 2)
    sent = {r.request_id: r for r in engine.requests[before:]}
    cont = sent["v4-g0-s0"]
    assert cont.prompt_ids == [MIXED, 7, 2, 1, 5] and cont.sampling.max_new_tokens == 6
    # every prompt drawn so far is in exactly one place: a batch or the carried tail
    carried = [g.prompt.index for g in mgr._carry]
    assert sorted([0, 1, 2, 3] + carried) == list(range(8))


def test_tail_too_stale_for_the_pipeline_starts_over_and_is_counted():
    # one_step_off/async (partial_max_lag=0): a carried response from an older version restarts
    engine = ScriptedEngine("e0", slow_prompts=range(2, 6), keep_on_abort=2, slow_once=True)
    mgr = _carrying_manager(engine, partial_max_lag=0)
    data = Dataset([MIXED])
    mgr.collect(data, weight_version=3)
    engine.version = 4
    second = mgr.collect(data, weight_version=4)
    assert second.metrics["rollout/partial_tokens_restarted"] == 32
    for s in second.samples:
        assert s.token_versions == [4, 4, 4] and s.interrupted == 0


def test_carried_tail_travels_in_the_checkpoint():
    engine = ScriptedEngine("e0", slow_prompts=range(2, 6), keep_on_abort=2, slow_once=True)
    mgr = _carrying_manager(engine)
    data = Dataset([MIXED])
    mgr.collect(data, weight_version=3)
    state = json.loads(json.dumps(mgr.partial_state_dict()))  # what TrainerState stores
    assert len(state["groups"]) == 4

    engine.version = 4
    cursor = data.cursor
    resumed = _carrying_manager(engine)
    resumed.load_partial_state_dict(state)
    restored_data = Dataset([MIXED])
    restored_data.cursor = cursor
    a = mgr.collect(data, weight_version=4)
    b = resumed.collect(restored_data, weight_version=4)
    rows = lambda batch: [  # noqa: E731
        (s.prompt.index, s.response_ids, s.rollout_logprobs, s.token_versions, s.interrupted)
        for s in batch.samples
    ]
    assert rows(a) == rows(b) and rows(a)[0][3] == [3, 3, 4]


def test_an_engine_dying_mid_round_hands_its_partial_samples_to_another_engine():
    """e0 aborts its call itself after 2 of 3 tokens (as SGLang does with its running requests
    when it shuts down), and is dead for the next call (EngineError); meanwhile e1 is busy (one
    call per engine), so the retry first lands on e0 again. The group then runs on e1 from the
    2 tokens kept: the responses equal an uninterrupted rollout's, tokens [e0, e0, e1] by
    version, and no token is generated or counted twice."""
    from megatron_dapo.rollout.engine import EngineError

    def rollout(engines):
        # one group per call and one call per engine at a time: u0 -> e0, u1 -> e1
        cfg = manager_config(train_batch_size=2, gen_batch_size=2, partial=True, max_concurrency_per_engine=4)
        return RolloutManager(engines, Scorer(), cfg, Tokenizer()).collect(Dataset([MIXED]), weight_version=3)

    reference = rollout([ScriptedEngine("solo")])

    e0 = ScriptedEngine("e0", abort_calls={1}, keep_on_abort=2, die_at_call=2, dies_with=EngineError)
    e1 = ScriptedEngine("e1", hold=e0.dead)  # e1's first call ends only once e0 is dead
    e1.version = 4  # (an engine a version ahead, only to tell whose tokens are whose)
    batch = rollout([e0, e1])
    m = batch.metrics
    assert e0.calls == 2 and m["rollout/engines_down"] == 1
    assert [s.prompt.index for s in batch.samples] == [s.prompt.index for s in reference.samples]
    for s, ref in zip(batch.samples, reference.samples):
        assert s.response_ids == ref.response_ids and s.rollout_logprobs == ref.rollout_logprobs
        assert s.finish_reason == ref.finish_reason == "stop" and s.acc == ref.acc
    group0 = [s for s in batch.samples if s.prompt.index == 0]
    assert [s.token_versions for s in group0] == [[3, 3, 4]] * 4 and {s.interrupted for s in group0} == {1}
    assert {tuple(s.token_versions) for s in batch.samples if s.prompt.index == 1} == {(4, 4, 4)}
    # e1 continued prompt 0 after its 2 kept tokens, with the rest of the budget (8 - 2)
    cont = [r for r in e1.requests if r.prompt_ids[2] == 0]
    assert len(cont) == 4 and all(len(r.prompt_ids) == 5 and r.sampling.max_new_tokens == 6 for r in cont)
    # generated once each: 4 x 2 on e0 + 4 x 1 continued on e1 + 4 x 3 for prompt 1 = 2 x 4 x 3
    assert m["rollout/tokens_generated"] == 24 == reference.metrics["rollout/tokens_generated"]
    assert m["rollout/retries"] == 1 and accounted(m) == m["rollout/prompts_drawn"] == 2


def test_partial_off_keeps_discarding_the_tail():
    engine = ScriptedEngine("e0", slow_prompts=range(2, 6), keep_on_abort=2, slow_once=True)
    cfg = manager_config(train_batch_size=2, gen_batch_size=6)
    mgr = RolloutManager([engine], Scorer(), cfg, Tokenizer())
    m = mgr.collect(Dataset([MIXED]), 3).metrics
    assert m["rollout/unused"] == 4 and "rollout/partial_groups_carried" not in m
    assert mgr.partial_state_dict() == {}


# -- SGLang ------------------------------------------------------------------------------------


def test_sglang_aborted_reply_keeps_tokens_and_per_token_versions():
    # the reply TokenizerManager._handle_abort_req builds for a running request: output_token_logprobs
    # of the tokens so far, and meta_info.weight_versions spans (utils/weight_versions.py:
    # {"version": str, "start", "end"} over output positions) when the weights changed mid-request
    req = GenerationRequest("v3-g0-s0", [11, 12], SamplingParams(max_new_tokens=10))
    reply = {
        "text": "",
        "output_ids": [7, 8, 9],
        "meta_info": {
            "id": "v3-g0-s0",
            "finish_reason": {"type": "abort", "message": "Abort before prefill"},
            "weight_version": "4",
            "weight_versions": [
                {"version": "3", "start": 0, "end": 2},
                {"version": "4", "start": 2, "end": 3},
            ],
            "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None], [-0.3, 9, None]],
            "completion_tokens": 3,
        },
    }
    res = parse_generate_reply(reply, req, "sg")
    assert (res.output_ids, res.logprobs, res.finish_reason) == ([7, 8, 9], [-0.1, -0.2, -0.3], "abort")
    assert res.token_versions == [3, 3, 4] and res.weight_version == 4

    # its continuation: prompt + the 3 tokens as input_ids, 7 tokens of budget left
    payload = payload_generate(
        continuation(req.request_id, req.prompt_ids, from_result(res, None), req.sampling)
    )
    assert payload["input_ids"] == [11, 12, 7, 8, 9]
    assert payload["sampling_params"]["max_new_tokens"] == 7


@pytest.mark.parametrize("spans", [None, [{"version": "4", "start": 0, "end": 5}]])
def test_sglang_reply_without_matching_spans_takes_the_reply_version(spans):
    # no spans (the weights did not change during the request), or spans that do not cover the
    # tokens returned: every token is the reply's weight_version
    req = GenerationRequest("r", [1], SamplingParams(max_new_tokens=4))
    meta = {
        "finish_reason": {"type": "stop"},
        "weight_version": "5",
        "output_token_logprobs": [[-0.1, 3, None]],
    }
    if spans is not None:
        meta["weight_versions"] = spans
    assert parse_generate_reply({"meta_info": meta}, req, "sg").token_versions == [5]


# -- the trainer: the carried tail in its checkpoint -------------------------------------------


def _train(
    tmp_path, name, stop_after=None, resume="never", slow=range(2, 6), ranks=None, dataset=None, **over
):
    """The real manager (rollout.partial, built from the config) on the scripted engine in the
    trainer loop with checkpointing stand-in ranks; the samples each step trained on:
    (file row, response, per-token versions, interruptions, prompt text) per sample.
    ``dataset``: the prompts (default: the endless scripted mixed ones)."""
    from rollout_fakes import CheckpointedDataset
    from test_async import CheckpointingRanks
    from trainer_fakes import trainer_config

    from megatron_dapo.driver.run_dir import RunDir
    from megatron_dapo.driver.stop import StopFlag
    from megatron_dapo.driver.trainer import DAPOTrainer
    from megatron_dapo.rollout.manager import RolloutManagerConfig

    cfg = trainer_config(
        tmp_path,
        **{
            "trainer.run_name": name,
            "trainer.total_steps": 2,
            "trainer.train_batch_size": 2,
            "trainer.resume": resume,
            "trainer.save_freq": 1,
            "rollout.gen_batch_size": 6,
            "rollout.n": 4,
            "rollout.over_sample": "false",
            "rollout.partial": "true",
            "actor.ppo_mini_batch_size": 2,
            "data.max_response_length": 8,
            "algorithm.overlong_buffer.len": 4,
            **over,
        },
    )
    # prompts 2..5 are slow in step 1 only (a resumed run starts after it)
    engine = ScriptedEngine(
        "e0", slow_prompts=slow if resume == "never" else (), keep_on_abort=2, slow_once=True
    )
    engine.version = 0
    mcfg = RolloutManagerConfig.from_config(cfg)
    assert mcfg.partial and mcfg.partial_max_lag == (None if cfg.trainer.mode == "sync" else 0)
    manager = RolloutManager([engine], Scorer(), mcfg, Tokenizer())
    stop, trained = StopFlag(), {}

    def dump(rollout, path):
        step = int(path.stem.split("_")[1])
        trained[step] = [
            (s.prompt.index, s.response_ids, s.token_versions, s.interrupted, s.prompt.prompt_text)
            for s in rollout.samples
        ]
        if step == stop_after:
            stop.set("SIGTERM")

    def sync(version):
        engine.version = version
        return {}

    run = RunDir.create(cfg.trainer.runs_dir, name)
    trainer = DAPOTrainer(
        cfg,
        run=run,
        ranks=ranks(engine) if ranks is not None else CheckpointingRanks(),
        manager=manager,
        dataset=CheckpointedDataset([MIXED]) if dataset is None else dataset,
        transport_sync=sync,
        stop=stop,
        dump_rollouts=dump,
    )
    trainer.fit()
    metrics = {r["step"]: r for r in map(json.loads, run.metrics.read_text().splitlines())}
    return trained, metrics


def test_a_resume_continues_the_tail_the_checkpoint_carried(tmp_path):
    whole, metrics = _train(tmp_path, "whole")
    # step 2 trains prompts 2 and 3: 2 tokens of version 0 (step 1's tail), 1 of version 1
    assert [row[0] for row in whole[2][::4]] == [2, 3]
    assert {tuple(row[2]) for row in whole[2]} == {(0, 0, 1)} and {row[3] for row in whole[2]} == {1}
    assert metrics[2]["rollout/staleness_token_max"] == 1 and metrics[2]["rollout/staleness_sample_max"] == 1
    assert metrics[2]["rollout/partial_sample_fraction"] == 1.0

    _train(tmp_path, "cut", stop_after=1)
    ckpt = tmp_path / "cut" / "checkpoints" / "step_00000001"
    state = json.loads((ckpt / "state.json").read_text())
    # the tail is in the checkpoint's carried file (covered by its manifest); the trainer state
    # holds only its index
    assert state["partial_rollouts"] == {"file": CARRIED_FILE, "groups": 4, "samples": [4, 4, 4, 4]}
    assert state["carried"] == {} and CARRIED_FILE in json.loads((ckpt / MANIFEST).read_text())["files"]
    carried = carry_from_items(read_carried(ckpt / CARRIED_FILE), state["partial_rollouts"])
    assert [g.prompt.index for g in carried] == [2, 3, 4, 5]
    for g in carried:  # the scripted engine's first 2 tokens of each response, at version 0
        for j, s in enumerate(g.samples):
            assert (s.output_ids, s.logprobs, s.token_versions) == (
                [1 if j % 2 == 0 else 2, 5],
                [-0.5] * 2,
                [0, 0],
            )
            assert s.finish_reason is None and s.interrupted == 1
    # the form before the carried file: the groups as JSON in the trainer state, no file
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "cut", old)
    state["partial_rollouts"] = carry_to_state(carried)
    (old / ckpt.relative_to(tmp_path / "cut") / "state.json").write_text(json.dumps(state))
    (old / ckpt.relative_to(tmp_path / "cut") / CARRIED_FILE).unlink()
    write_manifest(old / ckpt.relative_to(tmp_path / "cut"))

    resumed, _ = _train(tmp_path, "cut", resume="auto")
    assert sorted(resumed) == [2] and resumed[2] == whole[2]
    resumed_old, _ = _train(tmp_path, "old", resume="auto")
    assert sorted(resumed_old) == [2] and resumed_old[2] == whole[2]


def test_one_step_off_carries_batch_and_tail_in_one_file_and_drop_on_resume_drops_both(tmp_path, caplog):
    """one_step_off: step 1's checkpoint holds step 2's finished batch (prompts 2, 3, continued
    from step 1's tail) and the tail past its cut (prompts 4..7), both in carried.safetensors. A
    resume continues both exactly; trainer.drop_carried_on_resume drops both: the cursor goes
    back to before step 2's new prompts (6) and step 1's tail (prompts 2..5, drawn before that
    cursor) comes back ahead of them, generated anew with version 1: nothing carried is
    continued and no prompt is skipped. A checkpoint whose start record predates that (no
    ``partial_tail``) skips them, as before, and the warning says so."""
    over = {"trainer.mode": "one_step_off", "trainer.placement": "disaggregated", "trainer.total_steps": 3}
    whole, _ = _train(tmp_path, "whole", **over)
    assert [row[0] for row in whole[2][::4]] == [2, 3] and [row[0] for row in whole[3][::4]] == [4, 5]
    _train(tmp_path, "cut", stop_after=1, **over)
    ckpt = tmp_path / "cut" / "checkpoints" / "step_00000001"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["carried"]["items"] == 1 and state["carried"]["starts"][0]["data_cursor"] == {"cursor": 6}
    assert state["carried"]["starts"][0]["partial_tail"] == [2, 3, 4, 5]  # step 1's tail, by position
    assert state["partial_rollouts"] == {"file": CARRIED_FILE, "groups": 4, "samples": [4, 4, 4, 4]}
    items = read_carried(ckpt / CARRIED_FILE)
    assert [s.prompt.index for s in items[0].samples[::4]] == [2, 3]
    assert [g.prompt.index for g in carry_from_items(items[1:], state["partial_rollouts"])] == [4, 5, 6, 7]

    shutil.copytree(tmp_path / "cut", tmp_path / "drop")
    # a checkpoint written before the start records held the tail: today's behaviour, said
    old = tmp_path / "old" / "checkpoints" / "step_00000001"
    shutil.copytree(tmp_path / "cut", tmp_path / "old")
    del state["carried"]["starts"][0]["partial_tail"]
    (old / "state.json").write_text(json.dumps(state))
    write_manifest(old)
    resumed, _ = _train(tmp_path, "cut", resume="auto", **over)
    # the carried batch is trained as the checkpoint holds it, to the token; both steps match
    # the uninterrupted run in prompts and responses (the weight versions of the tokens a
    # prefetch generates depend on when the sync's pause lands: README, rollout.partial)
    carried = [
        (s.prompt.index, s.response_ids, s.token_versions, s.interrupted, s.prompt.prompt_text)
        for s in items[0].samples
    ]
    assert sorted(resumed) == [2, 3] and resumed[2] == carried
    for step in (2, 3):
        assert [(r[4], r[1]) for r in resumed[step]] == [(r[4], r[1]) for r in whole[step]]
    dropped, metrics = _train(
        tmp_path, "drop", resume="auto", **over, **{"trainer.drop_carried_on_resume": "true"}
    )
    assert [row[0] for row in dropped[2][::4]] == [2, 3] and {tuple(row[2]) for row in dropped[2]} == {
        (1, 1, 1)
    }
    assert {row[3] for row in dropped[2]} == {0}  # generated from the prompt, never interrupted
    assert [row[0] for row in dropped[3][::4]] == [4, 5]
    assert metrics[2]["rollout/partial_groups_resumed"] == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, "megatron_dapo.driver.trainer"):
        skipped, _ = _train(
            tmp_path, "old", resume="auto", **over, **{"trainer.drop_carried_on_resume": "true"}
        )
    assert [row[0] for row in skipped[2][::4]] == [6, 7]  # prompts 2..5 never trained
    assert "rollout.partial's tail held when they began, so those are skipped" in caplog.text


class _DigitTokenizer:
    """Text "c 7 u" -> ids [c, 7, u]: the scripted engine's prompt form (class, 7, unique id)."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[int(t) for t in text.split()] for text in texts]}


def _two_files_dataset():
    """12 mixed prompts from two "files" whose rows are both numbered 0..5 (as load_prompt_rows
    numbers them), shuffled: a real PromptDataset, whose draw order is the reference."""
    from megatron_dapo.data.dataset import PromptDataset

    rows = [
        {
            "index": u % 6,
            "data_source": "scripted",
            "messages": [{"role": "user", "content": f"{MIXED} 7 {u}"}],
            "ground_truth": "right",
            "extra_info": {},
        }
        for u in range(12)
    ]
    return PromptDataset(rows, _DigitTokenizer(), max_prompt_length=8, apply_chat_template=False, seed=3)


@pytest.mark.parametrize(
    "mode", [{"trainer.mode": "one_step_off"}, {"trainer.mode": "async", "trainer.max_staleness": 2}]
)
def test_drop_carried_on_resume_trains_every_prompt_the_partial_tail_held(tmp_path, mode):
    """one_step_off or async K=2, rollout.partial, a real PromptDataset (two files, clashing row
    numbers): when step 2's batch began, the tail held 4 prompts drawn before its cursor. A resume
    that drops the carried batches (step 2's; with K=2 step 3's too) trains them anyway: over the interrupted and resumed runs, each
    prompt the dataset yielded up to the end cursor is trained once or waits in the final tail,
    none twice, none skipped; and two resumes of the one checkpoint train identical batches."""
    over = {**mode, "trainer.placement": "disaggregated", "trainer.total_steps": 3}
    first = [s.prompt_ids[2] for s in _two_files_dataset().next_batch(6)]
    cut, _ = _train(tmp_path, "cut", stop_after=1, slow=first[2:], dataset=_two_files_dataset(), **over)
    assert sorted(cut) == [1]
    ckpt = tmp_path / "cut" / "checkpoints" / "step_00000001"
    carried = json.loads((ckpt / "state.json").read_text())["carried"]
    assert carried["items"] == (2 if "trainer.max_staleness" in mode else 1)
    assert carried["starts"][0]["partial_tail"] == first[2:]
    shutil.copytree(tmp_path / "cut", tmp_path / "again")
    drop = {"trainer.drop_carried_on_resume": "true"}
    resumed, _ = _train(tmp_path, "cut", resume="auto", dataset=_two_files_dataset(), **over, **drop)
    again, _ = _train(tmp_path, "again", resume="auto", dataset=_two_files_dataset(), **over, **drop)
    # step 2 is generated after the resume, before anything runs alongside: identical to the
    # token; step 3 is prefetched while step 2 trains, and with rollout.partial the weight
    # version of its tokens depends on when the sync's pause lands (README), so its prompts and
    # responses are compared
    assert sorted(resumed) == [2, 3] and again[2] == resumed[2]
    assert [(r[4], r[1]) for r in again[3]] == [(r[4], r[1]) for r in resumed[3]]

    end = tmp_path / "cut" / "checkpoints" / "step_00000003"
    state = json.loads((end / "state.json").read_text())
    assert state["carried"] == {}
    drawn = state["data_cursor"]["epoch"] * 12 + state["data_cursor"]["index"]
    tail = [
        g.prompt.prompt_text
        for g in carry_from_items(read_carried(end / CARRIED_FILE), state["partial_rollouts"])
    ]
    yielded = [s.prompt_text for s in _two_files_dataset().next_batch(drawn)]
    trained = [row[4] for rows in (cut[1], resumed[2], resumed[3]) for row in rows[::4]]
    assert sorted(trained + tail) == sorted(yielded)
    assert len(trained) == len(set(trained)) == 6 and not set(trained) & set(tail)


def test_a_torn_partial_tail_rejects_its_checkpoint_naming_it(tmp_path):
    _train(tmp_path, "cut", stop_after=1)
    ckpt = tmp_path / "cut" / "checkpoints" / "step_00000001"
    victim = ckpt / CARRIED_FILE
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(ckpt)
    assert f"{victim} is truncated" in str(e.value) and "\n" not in str(e.value)
    write_manifest(ckpt)  # a torn file the manifest does not catch: the reader names it
    with pytest.raises(CheckpointError) as e:
        _train(tmp_path, "cut", resume=str(ckpt))
    assert str(victim) in str(e.value) and "\n" not in str(e.value)


def test_a_weight_sync_pauses_the_running_rollout_which_continues_with_the_new_weights(tmp_path):
    """one_step_off: step 2's batch (prompts 2, 3) is generated while the actor trains step 1. The
    sync of step 1 does not wait for it: the rollout is paused (its calls aborted after 2 of 3
    tokens, which are kept), the engine gets version 1, and the rollout continues: every
    response is [v0, v0, v1], within one_step_off's bound (actor version 1 at step 2)."""
    from test_async import CheckpointingRanks

    class RanksTrainingWhileGenerating(CheckpointingRanks):
        def __init__(self, engine):
            super().__init__()
            self.engine = engine

        def call(self, method, *args, **kwargs):
            if method == "train_step" and not any(m == "train_step" for m, _ in self.calls):
                # step 1's update ends only once step 2's rollout has both its calls generating
                with self.engine.blocked_changed:
                    assert self.engine.blocked_changed.wait_for(lambda: self.engine.blocked == 2, 60)
            return super().call(method, *args, **kwargs)

    trained, metrics = _train(
        tmp_path,
        "pipelined",
        slow=(2, 3),
        ranks=RanksTrainingWhileGenerating,
        **{"trainer.mode": "one_step_off", "trainer.placement": "disaggregated", "rollout.gen_batch_size": 2},
    )
    assert [row[0] for row in trained[1][::4]] == [0, 1]
    assert {tuple(row[2]) for row in trained[1]} == {(0, 0, 0)}
    assert [row[0] for row in trained[2][::4]] == [2, 3]
    assert {tuple(row[2]) for row in trained[2]} == {(0, 0, 1)} and {row[3] for row in trained[2]} == {1}
    for j, row in enumerate(trained[2]):
        assert row[1] == [1 if j % 2 == 0 else 2, 5, 5]  # the response is whole, nothing doubled
    assert metrics[2]["rollout/staleness_token_max"] == 1 and metrics[2]["rollout/stale_dropped_samples"] == 0
    assert "timing/pause_rollout" in metrics[1] and "timing/pause_rollout" not in metrics[2]
