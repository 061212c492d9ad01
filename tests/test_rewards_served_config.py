"""``reward.model`` / ``reward.combine``: off by default, every misuse refused in one line naming the
key and the fix, and the section read into the clients' settings and the servers to start."""

from __future__ import annotations

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.rewards.served.settings import server_specs, settings_from_config


def load(*overrides: str):
    return load_config(None, ["model.path=/x", *overrides])


def test_the_settings_read_every_knob_from_the_section_and_copy_none():
    import dataclasses

    from megatron_dapo.config.schema import RewardModelConfig
    from megatron_dapo.rewards.served.settings import ServedRewardSettings

    # the section itself and reward.combine: no knob of its own to drift from the schema
    assert [f.name for f in dataclasses.fields(ServedRewardSettings)] == ["model", "combine"]
    cfg = load("reward.model.kind=judge", "reward.model.url=http://j:1", "reward.model.max_restarts=7")
    s = settings_from_config(cfg.reward)
    for f in dataclasses.fields(RewardModelConfig):
        assert getattr(s, f.name) == cfg.reward.model[f.name], f.name
    assert s.max_restarts == 7 and s.replace(max_restarts=1).max_restarts == 1 and s.max_restarts == 7


def test_off_by_default():
    cfg = load()
    assert cfg.reward.model.kind is None and cfg.reward.combine is None
    assert settings_from_config(cfg.reward) is None


JUDGE = ("reward.model.kind=judge", "reward.model.url=http://judge:8000")
CLASSIFIER = ("reward.model.kind=classifier", "reward.model.path=/ckpt/rm")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["reward.model.path=/rm"], "reward.model.path is set but reward.model.kind is null"),
        (["reward.combine=/c.py:mix"], "reward.combine mixes the rule reward with a model's score"),
        (["reward.model.kind=grader"], "reward.model.kind='grader' is not one of None, classifier, judge"),
        (["reward.model.kind=judge"], "needs exactly one of reward.model.path"),
        ([*CLASSIFIER, "reward.model.url=http://h:1"], "needs exactly one of reward.model.path .*, not both"),
        (
            ["reward.model.kind=judge", "reward.model.url=judge:8000"],
            "reward.model.url='judge:8000' is not http",
        ),
        ([*JUDGE, "reward.model.num_servers=2"], "with reward.model.url leave it 1"),
        ([*JUDGE, "reward.model.timeout_s=0"], r"reward.model.timeout_s=0(\.0)? must be > 0"),
        ([*JUDGE, "reward.model.max_retries=-1"], "reward.model.max_retries=-1 must be >= 0"),
        ([*JUDGE, "reward.model.max_in_flight=0"], "reward.model.max_in_flight=0 must be >= 1"),
        ([*CLASSIFIER, "reward.model.gpus_per_server=0"], "reward.model.gpus_per_server=0 must be >= 1"),
        ([*JUDGE, "reward.model.down_grace_s=0"], "reward.model.down_grace_s=0(\\.0)? must be > 0"),
        ([*JUDGE, "reward.model.max_restarts=-1"], "reward.model.max_restarts=-1 must be >= 0"),
        ([*JUDGE, "reward.model.too_long=drop"], "reward.model.too_long='drop' is not one of cut, unscored"),
        (
            [*CLASSIFIER, "reward.model.too_long=unscored"],
            "reward.model.too_long applies to reward.model.kind=judge",
        ),
        ([*CLASSIFIER, "reward.model.transform=scale"], "reward.model.transform='scale' must look like"),
        ([*CLASSIFIER, "reward.combine=mix.py"], "reward.combine='mix.py' must look like"),
        (
            [*CLASSIFIER, "reward.model.parser=boxed_score"],
            "reward.model.parser applies to reward.model.kind=judge",
        ),
        (
            [*CLASSIFIER, "reward.model.temperature=0.7"],
            "reward.model.temperature applies to reward.model.kind=judge",
        ),
        (
            [*JUDGE, "reward.model.transform=/t.py:f"],
            "reward.model.transform applies to reward.model.kind=classifier",
        ),
        (
            [*JUDGE, "reward.model.probe_tolerance=0.01"],
            "reward.model.probe_tolerance applies to reward.model.kind=classifier",
        ),
        (
            [*JUDGE, "reward.model.parser=yes_or_no"],
            "is not one of yes_no, boxed_score .*did you mean 'yes_no'",
        ),
        ([*JUDGE, "reward.model.temperature=-1"], "reward.model.temperature=-1(\\.0)? must be >= 0"),
        ([*JUDGE, "reward.model.max_new_tokens=0"], "reward.model.max_new_tokens=0 must be >= 1"),
        ([*JUDGE, "reward.model.prompt_template='Grade {question}'"], "has no {response}"),
        (
            [*JUDGE, "reward.model.prompt_template='{question} {response} vs {answer}'"],
            r"has \{answer\}, which nothing fills in; the placeholders are \{question\}",
        ),
    ],
)
def test_misuse_is_refused_naming_the_key_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        load(*overrides)
    assert "\n" not in str(e.value)


def test_a_template_may_hold_latex_braces():
    template = r"'Score {response} against {ground_truth} from 0 to 10 as \boxed{x}.'"
    cfg = load(*JUDGE, f"reward.model.prompt_template={template}", "reward.model.parser=boxed_score")
    assert settings_from_config(cfg.reward).prompt_template.endswith(r"\boxed{x}.")


def test_the_section_becomes_the_clients_settings():
    cfg = load(
        *CLASSIFIER,
        "reward.model.num_servers=2",
        "reward.model.gpus_per_server=4",
        "reward.model.timeout_s=15",
        "reward.model.max_retries=5",
        "reward.model.max_in_flight=7",
        "reward.model.down_grace_s=90",
        "reward.model.transform=/t.py:sigmoid",
        "reward.combine=/c.py:mix",
    )
    s = settings_from_config(cfg.reward)
    assert (s.kind, s.path, s.url, s.num_servers, s.gpus_per_server) == ("classifier", "/ckpt/rm", None, 2, 4)
    assert (s.timeout_s, s.max_retries, s.max_in_flight, s.down_grace_s) == (15.0, 5, 7, 90.0)
    assert (s.transform, s.combine) == ("/t.py:sigmoid", "/c.py:mix")
    specs = server_specs(s, model_path="/runs/x/served_rm")
    assert [(p.index, p.model_path, p.tp_size, p.extra_args) for p in specs] == [
        (0, "/runs/x/served_rm", 4, ("--is-embedding",)),
        (1, "/runs/x/served_rm", 4, ("--is-embedding",)),
    ]


def test_a_judge_s_sampling_is_its_own():
    cfg = load(
        *JUDGE, "reward.model.parser=/p.py:grade", "reward.model.max_new_tokens=64", "rollout.temperature=1.0"
    )
    s = settings_from_config(cfg.reward)
    assert (s.parser, s.temperature, s.max_new_tokens, s.prompt_template) == ("/p.py:grade", 0.0, 64, None)
    assert server_specs(s) == [], "a server given by URL is not started by the run"
    judge_served = settings_from_config(load("reward.model.kind=judge", "reward.model.path=/j").reward)
    assert server_specs(judge_served)[0].extra_args == ()
