"""PromptDataset: tokenisation, length filter, chat template, seeded shuffling, resumable cursor."""

import numpy as np
import pytest
from built import SHARED_DATA
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from megatron_dapo.data import DataError, PromptDataset, load_prompt_rows

AIME = SHARED_DATA / "aime-2024.parquet"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def byte_tokenizer():
    """One token per UTF-8 byte, plus a BOS added as the special token; built locally, no download."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def rows_of(contents):
    return [
        {
            "index": i,
            "data_source": "math_dapo",
            "messages": [{"role": "user", "content": c}],
            "ground_truth": str(i),
            "extra_info": {"k": i},
        }
        for i, c in enumerate(contents)
    ]


def make(rows, tok, **kw):
    args = {"max_prompt_length": 1000, "apply_chat_template": False, "seed": 7}
    args.update(kw)
    return PromptDataset(rows, tok, **args)


def test_plain_tokenisation_adds_bos(byte_tokenizer):
    ds = make(rows_of(["héllo"]), byte_tokenizer, shuffle=False)
    s = ds[0]
    assert s.prompt_text == "héllo"
    assert len(s.prompt_ids) == 1 + len("héllo".encode())  # BOS + one token per byte
    assert byte_tokenizer.decode(s.prompt_ids, skip_special_tokens=True) == "héllo"
    assert (s.index, s.data_source, s.ground_truth, s.extra_info) == (0, "math_dapo", "0", {"k": 0})


def test_chat_template_text_and_no_extra_specials(byte_tokenizer):
    ds = make(rows_of(["hi"]), byte_tokenizer, apply_chat_template=True)
    s = ds[0]
    assert s.prompt_text == "<|user|>hi\n<|assistant|>"
    assert len(s.prompt_ids) == len(s.prompt_text.encode())  # the template's own text, no BOS added


def test_chat_template_missing_is_a_clear_error(byte_tokenizer):
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer.backend_tokenizer)
    with pytest.raises(DataError, match="apply_chat_template=false"):
        make(rows_of(["hi"]), tok, apply_chat_template=True)


def test_length_filter_counts_and_keeps_order(byte_tokenizer):
    # token counts with BOS: 1 + bytes -> 4, 11, 6, 21
    ds = make(
        rows_of(["abc", "a" * 10, "abcde", "b" * 20]), byte_tokenizer, max_prompt_length=6, shuffle=False
    )
    assert ds.stats == {"rows": 4, "kept": 2, "too_long": 2, "longest_prompt_tokens": 21}
    assert [s.index for s in ds.samples] == [0, 2]  # source positions kept
    with pytest.raises(DataError, match="longest prompt: 21 tokens"):
        make(rows_of(["a" * 10, "b" * 20]), byte_tokenizer, max_prompt_length=6)


def test_shuffle_is_numpy_randomstate_of_seed_plus_epoch(byte_tokenizer):
    n = 10
    ds = make(rows_of([f"p{i}" for i in range(n)]), byte_tokenizer, seed=7)
    epoch0 = [s.index for s in ds.next_batch(n)]
    epoch1 = [s.index for s in ds.next_batch(n)]
    assert epoch0 == np.random.RandomState(7).permutation(n).tolist()
    assert epoch1 == np.random.RandomState(8).permutation(n).tolist()
    assert epoch0 != epoch1 and ds.epoch == 2
    again = make(rows_of([f"p{i}" for i in range(n)]), byte_tokenizer, seed=7)
    assert [s.index for s in again.next_batch(n)] == epoch0


def test_unshuffled_batches_wrap_into_next_epoch(byte_tokenizer):
    ds = make(rows_of([f"p{i}" for i in range(5)]), byte_tokenizer, shuffle=False)
    assert [s.index for s in ds.next_batch(3)] == [0, 1, 2]
    assert [s.index for s in ds.next_batch(3)] == [3, 4, 0]
    assert ds.state_dict() == {"epoch": 1, "index": 1, "num_samples": 5}
    assert [s.index for s in ds.next_batch(7)] == [1, 2, 3, 4, 0, 1, 2]  # a batch longer than an epoch


def test_resume_sees_the_same_prompts(byte_tokenizer):
    rows = rows_of([f"problem {i}" for i in range(13)])
    uninterrupted = make(rows, byte_tokenizer, seed=3)
    reference = [[s.index for s in uninterrupted.next_batch(4)] for _ in range(10)]

    first = make(rows, byte_tokenizer, seed=3)
    seen = [[s.index for s in first.next_batch(4)] for _ in range(4)]
    state = first.state_dict()
    resumed = make(rows, byte_tokenizer, seed=3)
    resumed.load_state_dict(dict(state))
    seen += [[s.index for s in resumed.next_batch(4)] for _ in range(6)]
    assert seen == reference


def test_load_state_dict_validation(byte_tokenizer):
    ds = make(rows_of(["a", "b", "c"]), byte_tokenizer)
    with pytest.raises(DataError, match="for 4 prompts but this dataset has 3"):
        ds.load_state_dict({"epoch": 0, "index": 1, "num_samples": 4})
    with pytest.raises(ValueError, match="out of range"):
        ds.load_state_dict({"epoch": 0, "index": 3})
    with pytest.raises(ValueError, match="integer 'epoch' and 'index'"):
        ds.load_state_dict({"epoch": 0})
    ds.load_state_dict({"epoch": 2, "index": 1})  # an older state without num_samples is fine
    assert ds.state_dict() == {"epoch": 2, "index": 1, "num_samples": 3}


def test_rows_not_from_the_loader_are_rejected(byte_tokenizer):
    with pytest.raises(DataError, match=r"row 0 lacks \['index'"):
        make([{"messages": []}], byte_tokenizer)


@pytest.mark.needs_built(AIME.exists(), f"shared AIME 2024 parquet not present: {AIME}")
def test_aime_rows_through_the_chat_template(byte_tokenizer):
    rows = load_prompt_rows(str(AIME))
    ds = PromptDataset(rows, byte_tokenizer, max_prompt_length=2048, apply_chat_template=True, seed=1)
    assert len(ds) == 960 and ds.stats["too_long"] == 0
    s = ds[0]
    assert s.prompt_text == f"<|user|>{rows[0]['messages'][0]['content']}\n<|assistant|>"
    assert len(s.prompt_ids) == len(s.prompt_text.encode())
    assert s.ground_truth == "540"


def test_position_of_tells_apart_two_train_files_with_the_same_row_indices(byte_tokenizer, tmp_path):
    """Two jsonl files, each with rows 0..2 (same data_source, same answers): ``index`` clashes,
    the position does not; a copy (as a checkpoint reads it back) is found too; a row the length
    filter dropped shifts every later position."""
    import dataclasses
    import json

    files = []
    for name, problems in (("a", ["one", "two" * 200, "three"]), ("b", ["four", "five", "six"])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"problem": p, "answer": "7"}) + "\n" for p in problems))
        files.append(str(path))
    rows = [r for f in files for r in load_prompt_rows(f, template="none")]
    assert [r["index"] for r in rows] == [0, 1, 2, 0, 1, 2]
    ds = make(rows, byte_tokenizer, max_prompt_length=50)  # "two" * 200 is dropped
    # by hand: kept rows in file order are a0, a2, b0, b1, b2
    texts = ["one", "three", "four", "five", "six"]
    assert [s.prompt_text for s in ds.samples] == texts
    for sample in ds.next_batch(len(ds)):  # shuffled draw order
        pos = texts.index(sample.prompt_text)
        assert ds.position_of(sample) == pos
        assert ds.position_of(dataclasses.replace(sample, prompt_ids=list(sample.prompt_ids))) == pos
    assert (ds.position_of(ds[0]), ds.position_of(ds[2])) == (0, 2)  # both row 0 of their file
    with pytest.raises(DataError) as e:
        ds.position_of(dataclasses.replace(ds[0], prompt_text="elsewhere"))
    assert "data.train_files" in str(e.value) and "\n" not in str(e.value)
