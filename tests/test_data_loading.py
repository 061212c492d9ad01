"""load_prompt_rows on synthetic verl / jsonl / plain files, bad rows, and the shared DAPO data."""

import json
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from built import SHARED_DATA

from megatron_dapo.data import DAPO_TEMPLATE, DataError, apply_template, load_prompt_rows
from megatron_dapo.rewards import Scorer

AIME = SHARED_DATA / "aime-2024.parquet"
DAPO17K = SHARED_DATA / "dapo_math_17k.SvS.parquet"

TEMPLATE_HEAD = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
TEMPLATE_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'


def verl_row(problem, gt, source="math_dapo", templated=False):
    content = TEMPLATE_HEAD + problem + TEMPLATE_TAIL if templated else problem
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "MATH",
        "reward_model": {"ground_truth": gt, "style": "rule"},
        "extra_info": {"index": 0},
    }


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_template_text_is_verbatim():
    assert DAPO_TEMPLATE == TEMPLATE_HEAD + "{problem}" + TEMPLATE_TAIL
    # braces in the problem are safe (no str.format)
    assert apply_template("f(x) = {x}", "dapo") == TEMPLATE_HEAD + "f(x) = {x}" + TEMPLATE_TAIL
    assert apply_template("q", "Q: {problem} A:") == "Q: q A:"
    assert apply_template("q", "none") == "q"
    with pytest.raises(ValueError, match="must be one of auto, dapo, none"):
        apply_template("q", "chatml")


def test_verl_parquet_auto_template(tmp_path):
    rows = [verl_row("What is 1+1?", "2"), verl_row("What is 2+2?", "4", templated=True, source="aime24")]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    out = load_prompt_rows(str(path))
    assert [r["index"] for r in out] == [0, 1]
    assert [r["data_source"] for r in out] == ["math_dapo", "aime24"]
    assert [r["ground_truth"] for r in out] == ["2", "4"]
    # auto: the bare problem gets the template, the templated one is not wrapped twice
    assert [r["messages"][0]["content"] for r in out] == [
        TEMPLATE_HEAD + "What is 1+1?" + TEMPLATE_TAIL,
        TEMPLATE_HEAD + "What is 2+2?" + TEMPLATE_TAIL,
    ]
    assert out[0]["extra_info"] == {"index": 0}
    plain = load_prompt_rows(str(path), template="none")
    assert plain[0]["messages"][0]["content"] == "What is 1+1?"


def test_template_goes_to_last_user_message(tmp_path):
    row = verl_row("x", "1")
    row["prompt"] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What is 3?"},
    ]
    out = load_prompt_rows(str(write_jsonl(tmp_path / "c.jsonl", [row])), template="dapo")
    contents = [m["content"] for m in out[0]["messages"]]
    assert contents == ["be brief", "first", "ok", TEMPLATE_HEAD + "What is 3?" + TEMPLATE_TAIL]


def test_plain_problem_answer_layout(tmp_path):
    path = write_jsonl(
        tmp_path / "plain.jsonl", [{"problem": "1+2?", "answer": 3}, {"problem": "2+5?", "answer": "7"}]
    )
    out = load_prompt_rows(str(path))
    assert [r["ground_truth"] for r in out] == ["3", "7"]  # integers become strings
    assert out[0]["data_source"] == "math_dapo" and out[0]["extra_info"] == {}
    assert out[0]["messages"] == [{"role": "user", "content": TEMPLATE_HEAD + "1+2?" + TEMPLATE_TAIL}]
    custom = load_prompt_rows(str(path), prompt_key="problem", answer_key="answer", template="Q: {problem}")
    assert custom[1]["messages"][0]["content"] == "Q: 2+5?"


def test_json_array_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([verl_row("a?", "1"), verl_row("b?", "2")]))
    assert [r["ground_truth"] for r in load_prompt_rows(str(path))] == ["1", "2"]


BAD_ROWS = [
    ({"prompt": "p", "reward_model": {"style": "rule"}}, "no ground truth"),
    (
        {"prompt": "p", "reward_model": {"ground_truth": 1.5}},
        "'reward_model.ground_truth' .* string or integer",
    ),
    ({"prompt": "p", "reward_model": {"ground_truth": " "}}, "ground truth\\) is empty"),
    ({"prompt": "   ", "answer": "1"}, "the prompt is empty"),
    ({"prompt": [], "answer": "1"}, "non-empty list"),
    ({"prompt": 7, "answer": "1"}, "non-empty list of chat messages or a string"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "'prompt'\\[0\\] must be a message"),
    ({"prompt": [{"role": "system", "content": "s"}], "answer": "1"}, "no message with role 'user'"),
    ({"answer": "1"}, "field 'problem' is missing"),
    ({"prompt": "p", "answer": "1", "data_source": 3}, "'data_source' must be a non-empty string"),
    ({"prompt": "p", "answer": "1", "extra_info": [1]}, "'extra_info' must be an object"),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS)
def test_bad_row_names_file_line_and_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [verl_row("ok?", "1"), bad])
    with pytest.raises(DataError, match=message) as err:
        load_prompt_rows(str(path))
    assert f"{path}, line 2:" in str(err.value) and "skip_bad_rows" in str(err.value)


def test_skip_bad_rows_counts_and_keeps_indices(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps(verl_row("ok?", "1"))
    path.write_text("\n".join([good, "{not json", json.dumps({"prompt": "p"}), "", good]) + "\n")
    with pytest.raises(DataError, match="line 2: invalid JSON"):
        load_prompt_rows(str(path))
    stats = {}
    out = load_prompt_rows(str(path), skip_bad_rows=True, stats=stats)
    assert [r["index"] for r in out] == [0, 3]  # positions in the file survive skipping
    assert stats["rows_read"] == 4 and stats["rows_skipped"] == 2
    assert "line 3: no ground truth" in stats["skipped"][1]


def test_parquet_row_numbers_in_errors(tmp_path):
    path = tmp_path / "t.parquet"
    rows = [verl_row("a?", "1"), verl_row("b?", "2"), verl_row("c?", "3")]
    rows[2]["reward_model"] = {"ground_truth": None, "style": "rule"}
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"t\.parquet, row 2: no ground truth"):
        load_prompt_rows(str(path))


def test_missing_sources_and_formats(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_prompt_rows(str(tmp_path / "nope.parquet"))
    with pytest.raises(DataError, match="unknown data format 'csv'"):
        load_prompt_rows(str(tmp_path / "x.csv"), format="csv")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="cannot tell the format"):
        load_prompt_rows(str(tmp_path / "x.txt"))
    with pytest.raises(ValueError, match="template must be one of"):
        load_prompt_rows(str(tmp_path / "x.txt"), template="bogus")


def test_hf_name_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError, match="needs the `datasets` package"):
        load_prompt_rows("BytedTsinghua-SIA/DAPO-Math-17k")


@pytest.mark.needs_built(AIME.exists(), f"shared AIME 2024 parquet not present: {AIME}")
def test_aime_2024_parquet():
    rows = load_prompt_rows(str(AIME))
    assert len(rows) == 960
    assert len({r["messages"][0]["content"] for r in rows}) == 30
    assert all(c == 32 for c in Counter(r["messages"][0]["content"] for r in rows).values())
    assert {r["data_source"] for r in rows} == {"math_dapo"}
    # the file already holds the DAPO template: auto leaves it alone, and it is our template verbatim
    for r in rows:
        assert r["messages"][0]["content"] == DAPO_TEMPLATE.replace(
            "{problem}", r["extra_info"]["raw_problem"]
        )
    # every ground truth, written as the template asks, earns +1 from the DAPO rule
    with Scorer() as scorer:
        results = scorer.score_many(
            [
                (r["data_source"], f"...reasoning...\nAnswer: {r['ground_truth']}", r["ground_truth"])
                for r in rows
            ]
        )
    assert all(x.score == 1.0 and x.acc for x in results)
    assert scorer.stats["errors"] == 0


@pytest.mark.needs_built(DAPO17K.exists(), f"shared DAPO-Math-17k parquet not present: {DAPO17K}")
def test_dapo_math_17k_parquet_gets_template():
    rows = load_prompt_rows(str(DAPO17K))
    assert len(rows) == 17917
    assert {r["data_source"] for r in rows} == {"DAPO-17k"}
    assert all(r["messages"][0]["content"].startswith(TEMPLATE_HEAD) for r in rows)
    assert all(r["messages"][0]["content"].endswith(TEMPLATE_TAIL) for r in rows)
    assert all(r["ground_truth"].lstrip("-").isdigit() for r in rows)
    assert len({r["messages"][0]["content"] for r in rows}) == 17290
    assert [r["index"] for r in rows] == list(range(17917))
