"""prepare_demo_assets with a tiny warm start: loadable files, caching, and rebuild on change."""

import io
import json
from dataclasses import replace

import pyarrow.parquet as pq
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_dapo.demo.assets import prepare_demo_assets
from megatron_dapo.demo.recipe import DEMO_RECIPE
from megatron_dapo.demo.task import make_problems
from megatron_dapo.rewards.math_dapo import compute_score


def _quiet():
    return Console(file=io.StringIO(), width=100)


def test_assets_are_loadable_and_cached(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "assets"
    assets = prepare_demo_assets(out, seed=0, sft_steps=3, eval_problems=8, console=_quiet())
    assert not assets.reused and 0.0 <= assets.initial_accuracy <= 1.0

    train = pq.read_table(assets.train_file).to_pylist()
    val = pq.read_table(assets.val_file).to_pylist()
    assert (len(train), len(val)) == (DEMO_RECIPE.num_train, DEMO_RECIPE.num_val)
    assert val[0]["reward_model"]["style"] == "rule" and val[0]["extra_info"]["split"] == "test"
    # The stored rows are the generator's problems, and their ground truth scores them.
    _, problems = make_problems(0, DEMO_RECIPE.num_train, DEMO_RECIPE.num_val)
    assert val[5]["prompt"][0]["content"] == problems[5].question
    assert compute_score(problems[5].solution, val[5]["reward_model"]["ground_truth"])["score"] == 1.0

    tok = AutoTokenizer.from_pretrained(str(assets.hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(assets.hf_dir))
    prompt = tok.apply_chat_template(
        val[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert prompt["input_ids"].shape[1] <= DEMO_RECIPE.max_prompt_length
    with torch.no_grad():
        out_ids = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out_ids.shape[1] == prompt["input_ids"].shape[1] + 4 or tok.eos_token_id in out_ids[0].tolist()

    again = prepare_demo_assets(out, seed=0, sft_steps=3, eval_problems=8, console=_quiet())
    assert again.reused and again.initial_accuracy == assets.initial_accuracy

    rebuilt = prepare_demo_assets(out, seed=0, sft_steps=2, eval_problems=8, console=_quiet())
    assert not rebuilt.reused and rebuilt.sft_steps == 2


def test_warm_start_stops_at_the_probe_target_and_records_the_protocol(tmp_path):
    torch.set_num_threads(1)
    # Any accuracy reaches 0.0, so the first check (step 2) stops the warm start.
    recipe = replace(
        DEMO_RECIPE, sft_stop_accuracy=0.0, sft_min_steps=2, sft_check_every=1, sft_probe_problems=8
    )
    assets = prepare_demo_assets(
        tmp_path, seed=0, sft_steps=5, recipe=recipe, eval_problems=4, console=_quiet()
    )
    assert assets.sft_steps == 2
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["sft_steps"] == 2 and 0.0 <= manifest["sft_probe_accuracy"] <= 1.0
    assert manifest["key"]["eval"] == [DEMO_RECIPE.val_k, 1.0, 0.7, DEMO_RECIPE.val_seed]
    again = prepare_demo_assets(
        tmp_path, seed=0, sft_steps=5, recipe=recipe, eval_problems=4, console=_quiet()
    )
    assert again.reused and again.sft_steps == 2
