"""Config loading, overrides and the cross-field checks: each error names the key and the fix."""

import json

import pytest

from megatron_dapo.cli import main
from megatron_dapo.config import ConfigError, all_keys, load_config


def _load(*overrides, path=None):
    return load_config(path, ["model.path=/nonexistent", *overrides])


def test_defaults_follow_the_dapo_recipe():
    cfg = _load()
    assert cfg.algorithm.clip_ratio_low == 0.2 and cfg.algorithm.clip_ratio_high == 0.28
    assert cfg.algorithm.loss_agg_mode == "token-mean"
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.max_num_gen_batches == 10
    assert cfg.algorithm.overlong_buffer.len == 4096 and cfg.data.max_response_length == 20480
    assert cfg.rollout.n == 16 and cfg.trainer.train_batch_size == 512 and cfg.actor.ppo_mini_batch_size == 32


def test_overrides_are_typed():
    cfg = _load("rollout.n=8", "algorithm.clip_ratio_c=10", "data.train_files=[a.parquet,b.parquet]")
    assert cfg.rollout.n == 8 and cfg.algorithm.clip_ratio_c == 10.0
    assert list(cfg.data.train_files) == ["a.parquet", "b.parquet"]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algorithm.clip_ratio_hihg=0.3", "did you mean 'algorithm.clip_ratio_high'"),
        ("rollout.nn=3", "did you mean 'rollout.n'"),
        ("algoritm.loss_agg_mode=x", "did you mean 'algorithm'"),
        ("rollout.n=many", "bad value for 'rollout.n'"),
        ("algorithm.loss_agg_mode=mean", "algorithm.loss_agg_mode='mean' is not one of token-mean"),
        ("trainer.train_batch_size=100", "actor.ppo_mini_batch_size=25"),
        ("algorithm.overlong_buffer.len=30000", "data.max_response_length=20480"),
        ("algorithm.clip_ratio_c=0.5", "must be > 1"),
        ("algorithm.clip_ratio_low=1.5", "clip_ratio_low"),
        ("parallel.actor_world_size=6", "not a multiple of tp*pp*cp"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("model.fp8=e4m3", "model.fp8 needs Transformer Engine"),
        ("rollout.n", "not of the form key=value"),
        ("actor.logprob_chunk_tokens=0", "actor.logprob_chunk_tokens=0 must be >= 1"),
        ("actor.loss_scale_factor=0", "actor.loss_scale_factor=0 must be >= 1"),
        (
            "rollout.multi_turn.tokenization_sanity_check_mode=lenient",
            "rollout.multi_turn.tokenization_sanity_check_mode='lenient' is not one of strict, ignore_strippable",
        ),
    ],
)
def test_bad_values_name_the_key_and_fix(override, expected):
    extra = ["parallel.tensor_model_parallel_size=4"] if "actor_world_size" in override else []
    extra += ["model.transformer_impl=local"] if "fp8" in override else []
    with pytest.raises(ConfigError, match=None) as e:
        _load(*extra, override)
    assert expected in str(e.value)


def test_virtual_pipeline_is_refused_on_cpu():
    """Training under VPP is wrong on gloo (megatron-core's interleaved 1F1B schedule); MoE or not."""
    layout = ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"]
    with pytest.raises(
        ConfigError, match="parallel.virtual_pipeline_model_parallel_size=2 trains only on GPU"
    ):
        _load(*layout, "parallel.actor_world_size=4", "trainer.device=cpu")
    assert (
        _load(
            *layout, "parallel.actor_world_size=4", "trainer.device=cuda"
        ).parallel.pipeline_model_parallel_size
        == 2
    )


def test_missing_model_path_is_explained():
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, [])


def test_model_shape_checks_read_the_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24})
    )
    base = [f"model.path={tmp_path}"]
    with pytest.raises(ConfigError, match="use one of 1, 2, 7, 14"):
        load_config(None, [*base, "parallel.tensor_model_parallel_size=4", "parallel.actor_world_size=4"])
    with pytest.raises(ConfigError, match="key/value heads"):
        load_config(None, [*base, "parallel.tensor_model_parallel_size=7", "parallel.actor_world_size=7"])
    with pytest.raises(ConfigError, match="equal stages"):
        load_config(None, [*base, "parallel.pipeline_model_parallel_size=5", "parallel.actor_world_size=5"])
    ok = load_config(None, [*base, "parallel.tensor_model_parallel_size=2", "parallel.actor_world_size=2"])
    assert ok.parallel.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff=0.01 is for MoE models"):
        load_config(None, [*base, "actor.moe_aux_loss_coeff=0.01"])


def test_moe_checks_read_the_hf_config(tmp_path):
    """MoE with TP splits the experts over TP (their FFN size must divide); the load-balancing
    coefficient must be >= 0."""
    moe = {"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "num_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps({**moe, "moe_intermediate_size": 6}))
    base = [f"model.path={tmp_path}"]
    with pytest.raises(ConfigError, match="does not divide moe_intermediate_size=6"):
        load_config(None, [*base, "parallel.tensor_model_parallel_size=4", "parallel.actor_world_size=4"])
    with pytest.raises(ConfigError, match="actor.moe_aux_loss_coeff=-0.1 must be >= 0"):
        load_config(None, [*base, "actor.moe_aux_loss_coeff=-0.1"])
    ok = load_config(None, [*base, "parallel.tensor_model_parallel_size=2", "parallel.actor_world_size=2"])
    assert ok.actor.moe_aux_loss_coeff is None
    assert load_config(None, [*base, "actor.moe_aux_loss_coeff=0.001"]).actor.moe_aux_loss_coeff == 0.001
    # HF trains with its coefficient when output_router_logits: then recompute is refused
    (tmp_path / "config.json").write_text(
        json.dumps({**moe, "output_router_logits": True, "router_aux_loss_coef": 0.001})
    )
    with pytest.raises(ConfigError, match="set model.recompute=false or actor.moe_aux_loss_coeff=0"):
        load_config(None, [*base, "model.recompute=true"])
    assert load_config(None, [*base, "model.recompute=true", "actor.moe_aux_loss_coeff=0"]).model.recompute


def test_yaml_base_chain_and_unknown_yaml_key(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  path: /m\nrollout:\n  n: 4\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nrollout:\n  temperature: 0.9\n")
    cfg = load_config(tmp_path / "child.yaml", ["trainer.total_steps=3"])
    assert cfg.model.path == "/m" and cfg.rollout.n == 4 and cfg.rollout.temperature == 0.9
    assert cfg.trainer.total_steps == 3
    (tmp_path / "bad.yaml").write_text("model:\n  path: /m\n  dtpye: bf16\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*did you mean 'model.dtype'"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "loop.yaml")


def test_a_tool_yaml_beside_the_recipe_is_found_from_any_working_directory(tmp_path, monkeypatch):
    recipes, elsewhere = tmp_path / "recipes", tmp_path / "elsewhere"
    (recipes / "tools").mkdir(parents=True)
    (elsewhere / "cwd_tools").mkdir(parents=True)
    (recipes / "tools" / "t.yaml").write_text("tools: []\n")
    (elsewhere / "cwd_tools" / "t.yaml").write_text("tools: []\n")
    mt = "rollout:\n  multi_turn:\n    enable: true\n    tool_config_path: {}\n"
    (recipes / "base.yaml").write_text("model:\n  path: /m\n" + mt.format("tools/t.yaml"))
    (recipes / "child.yaml").write_text("base: base.yaml\n")
    (recipes / "verl_style.yaml").write_text("model:\n  path: /m\n" + mt.format("cwd_tools/t.yaml"))
    monkeypatch.chdir(elsewhere)
    beside = str(recipes / "tools" / "t.yaml")
    # read against the YAML that names it, inherited through base: as it is
    assert load_config(recipes / "base.yaml").rollout.multi_turn.tool_config_path == beside
    assert load_config(recipes / "child.yaml").rollout.multi_turn.tool_config_path == beside
    # not beside the YAML: left as written, for the working directory (verl's repo-relative paths)
    got = load_config(recipes / "verl_style.yaml").rollout.multi_turn.tool_config_path
    assert got == "cwd_tools/t.yaml"
    # an override is a shell path: the working directory's
    over = ["rollout.multi_turn.tool_config_path=tools/t.yaml"]
    assert load_config(recipes / "base.yaml", over).rollout.multi_turn.tool_config_path == "tools/t.yaml"


def test_verl_knob_names_exist():
    keys = set(all_keys())
    for k in [
        "algorithm.clip_ratio_low",
        "algorithm.clip_ratio_high",
        "algorithm.clip_ratio_c",
        "algorithm.loss_agg_mode",
        "algorithm.overlong_buffer.len",
        "algorithm.overlong_buffer.penalty_factor",
        "algorithm.filter_groups.enable",
        "algorithm.filter_groups.metric",
        "algorithm.filter_groups.max_num_gen_batches",
        "rollout.n",
        "data.max_prompt_length",
        "data.max_response_length",
    ]:
        assert k in keys


def test_cli_config_prints_and_fails_cleanly(capsys):
    assert main(["config", "--no-files", "model.path=/m", "rollout.n=5"]) == 0
    assert "'n': 5" in capsys.readouterr().out
    assert main(["config", "model.path=/m", "rollout.nn=5"]) == 2
    assert "did you mean 'rollout.n'" in capsys.readouterr().err


def test_logprob_chunk_default_is_the_kernels():
    from megatron_dapo.actor.logprobs import DEFAULT_CHUNK_TOKENS

    assert _load().actor.logprob_chunk_tokens == DEFAULT_CHUNK_TOKENS


def test_adaptive_kl_horizon_must_keep_the_coefficient_positive():
    """The demo's 512 responses a step (64 prompts x 8): with horizon=10 a KL below target made
    the coefficient 0.05 -> -0.462 -> -5.19 ...; the smallest safe horizon is > 0.2 x 512."""
    from megatron_dapo.algo import kl_control
    from megatron_dapo.config import validate

    base = [
        "model.path=/x",
        "trainer.train_batch_size=64",
        "rollout.gen_batch_size=64",
        "rollout.n=8",
        "actor.ppo_mini_batch_size=64",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
    ]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "algorithm.kl_ctrl.horizon=10"])
    msg = str(e.value)
    assert "algorithm.kl_ctrl.horizon=10" in msg and "512 responses" in msg and "> 102.4" in msg, msg
    assert "e.g. 103" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="horizon=102.4 "):
        load_config(None, [*base, "algorithm.kl_ctrl.horizon=102.4"])  # multiplier exactly 0
    assert load_config(None, [*base, "algorithm.kl_ctrl.horizon=103"]).algorithm.kl_ctrl.horizon == 103
    # the fixed controller ignores the horizon
    load_config(None, [*base[:-1], "algorithm.kl_ctrl.horizon=10"])
    # config/ keeps its own copy of the clip (it must not import torch through algo/)
    assert validate._ADAPTIVE_KL_ERROR_CLIP == kl_control._PROPORTIONAL_CLIP
