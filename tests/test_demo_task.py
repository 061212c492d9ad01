"""The demo task: determinism, disjoint splits, verl row layout, and math_dapo scoring."""

import pyarrow.parquet as pq

from megatron_dapo.demo.task import make_problems, split_triples, to_rows, write_parquet
from megatron_dapo.rewards.math_dapo import compute_score


def _key(p):
    return (p.op, p.a, p.b)


def test_same_seed_same_problems_other_seed_differs():
    a_train, a_val = make_problems(seed=3, num_train=300, num_val=50)
    b_train, b_val = make_problems(seed=3, num_train=300, num_val=50)
    c_train, _ = make_problems(seed=4, num_train=300, num_val=50)
    assert a_train == b_train and a_val == b_val
    assert a_train != c_train


def test_train_and_val_share_no_arithmetic():
    train, val = make_problems(seed=0, num_train=4000, num_val=200)
    assert len(val) == 200 and len({_key(p) for p in val}) == 200
    assert not {_key(p) for p in train} & {_key(p) for p in val}
    train_t, val_t = split_triples(seed=0, num_val=200)
    assert not set(train_t) & set(val_t)


def test_hand_checked_answers_and_wording():
    train, val = make_problems(seed=0, num_train=500, num_val=100)
    for p in train + val:
        expected = {"+": p.a + p.b, "-": p.a - p.b}[p.op]
        assert p.answer == expected >= 0
        assert f"{p.a} {p.op} {p.b}" in p.question


def test_reference_solution_scores_plus_one_and_wrong_answer_minus_one():
    train, val = make_problems(seed=1, num_train=400, num_val=100)
    for p in train + val:
        truth = str(p.answer)
        assert compute_score(p.solution, truth)["score"] == 1.0
        wrong = p.solution.rsplit("Answer: ", 1)[0] + f"Answer: {p.answer + 1}"
        assert compute_score(wrong, truth)["score"] == -1.0
    assert compute_score("12 + 3 = 15", "15")["score"] == -1.0  # no Answer line


def test_rows_match_verl_parquet_layout(tmp_path):
    _, val = make_problems(seed=0, num_train=10, num_val=20)
    path = write_parquet(to_rows(val, "test"), tmp_path / "val.parquet")
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 20
    first = rows[0]
    assert first["data_source"] == "math_dapo" and first["ability"] == "MATH"
    assert first["prompt"] == [{"role": "user", "content": val[0].question}]
    assert first["reward_model"] == {"ground_truth": str(val[0].answer), "style": "rule"}
    assert first["extra_info"] == {"index": 0, "split": "test"}
    assert [r["extra_info"]["index"] for r in rows] == list(range(20))
