"""Prompt files, datasets, chat templates, splits, truncation and the two collations (masks from lengths)."""

import json
import logging

import pytest
import torch
from conftest import DEV_PROMPTS, TRAIN_PROMPTS
from transformers import PreTrainedTokenizerFast

from decode.prompts import read_jsonl, render_prompt
from distill.config import DataConfig
from distill.data import prompt_gen
from distill.data.prompts import (
    collate_prompts,
    collate_training,
    encode_examples,
    load_rows,
    load_train_eval,
    render_completion,
    split_rows,
)
from tests.tiny import bpe_tokenizer, tiny_llama

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


SPECIALS = ["<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]  # ids 1-5


def tiny_tokenizer(bos: bool = False, chat: bool = False) -> PreTrainedTokenizerFast:
    """320-token BPE of two snippets; id 0 = <|endoftext|> = eos = pad.

    `bos` prepends <s> to every encoding; `chat` sets CHAT_TEMPLATE, whose bos is <s>.
    """
    return bpe_tokenizer(
        320,
        ["def f(x):\n    return x + 1\n", "hello world, the quick brown fox"],
        specials=SPECIALS,
        bos_token="<s>" if bos or chat else None,
        add_bos=bos,
        chat_template=CHAT_TEMPLATE if chat else None,
    )


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ---------------------------------------------------------------- reading


def test_read_jsonl_keeps_other_keys_and_skips_blank_lines(tmp_path):
    f = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"id": "a", "source": "x.py:1", "prompt": "def f("}),
            "",
            json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}]}),
        ],
    )
    rows = read_jsonl(f)
    assert [r["id"] for r in rows] == ["a", "b"]
    assert rows[0]["source"] == "x.py:1"


@pytest.mark.parametrize(
    "lines,match",
    [
        ([], r"prompt file is empty: .*p.jsonl has no prompts"),
        (["", "  "], r"p.jsonl has no prompts"),
        ([json.dumps({"prompt": "ok"}), '{"prompt": "broken'], r"p.jsonl:2: not valid JSON"),
        ([json.dumps({"prompt": "ok"}), json.dumps({"text": "x"})], r'p.jsonl:2: needs "prompt".*keys found: text'),
        ([json.dumps(["a list"])], r"p.jsonl:1: expected a JSON object"),
        ([json.dumps({"messages": [{"role": "user"}]})], r"p.jsonl:1: messages\[0\] must be an object"),
        ([json.dumps({"messages": []})], r"p.jsonl:1: 'messages' must be a non-empty list"),
    ],
    ids=["empty", "blank", "bad-json", "no-prompt", "not-object", "bad-message", "no-messages"],
)
def test_malformed_files_name_file_and_line(tmp_path, lines, match):
    f = _write(tmp_path / "p.jsonl", lines)
    with pytest.raises(ValueError, match=match) as e:
        read_jsonl(f)
    assert "\n" not in str(e.value)


def test_load_rows_from_datasets(tmp_path, monkeypatch):
    import datasets

    rows = [{"prompt": f"p{i}", "id": i} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(str(tmp_path / "ds")) == rows
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert load_rows(str(tmp_path / "dd"), split="test") == rows[:2]
    with pytest.raises(ValueError, match="no split 'validation'.*data.dataset_split"):
        load_rows(str(tmp_path / "dd"), split="validation")
    datasets.Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match='row 0: needs "prompt"'):
        load_rows(str(tmp_path / "bad"))
    assert load_rows(str(tmp_path / "bad"), prompt_field="text") == [{"text": "x"}]
    (tmp_path / "rows.json").write_text("\n".join(json.dumps(r) for r in rows))  # JSON lines, read by datasets
    assert load_rows(str(tmp_path / "rows.json"), split="validation") == rows  # one file: its only split
    # a table holding both kinds of rows has both columns, None where a row has no value
    mixed = [{"prompt": "raw", "messages": None}, {"prompt": None, "messages": [{"role": "user", "content": "hi"}]}]
    datasets.Dataset.from_list(mixed).save_to_disk(str(tmp_path / "mixed"))
    loaded = load_rows(str(tmp_path / "mixed"))
    assert loaded[0]["messages"] is None and loaded[1]["prompt"] is None
    assert [render_prompt(r, tiny_tokenizer())[0] for r in loaded] == ["raw", "hi\n\n"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"data.eval_prompts 'someone/prompts' not found.*HF_HUB_OFFLINE"):
        load_rows("someone/prompts", key="data.eval_prompts")
    with pytest.raises(ValueError, match=r"'./nope.jsonl' not found"):
        load_rows("./nope.jsonl")


def test_split_is_deterministic_and_order_independent():
    rows = [{"prompt": f"prompt number {i}"} for i in range(40)]
    train, evals = split_rows(rows, 0.1)
    assert len(evals) == 4 and len(train) == 36
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in evals)
    train2, evals2 = split_rows(list(reversed(rows)), 0.1)
    assert sorted(r["prompt"] for r in evals2) == sorted(r["prompt"] for r in evals)
    assert train == [r for r in rows if r not in evals]  # original order kept
    assert split_rows(rows, 0.0) == (rows, [])
    assert len(split_rows(rows[:1], 0.5)[0]) == 1  # never empties the training set


def test_load_train_eval(tmp_path):
    train = _write(tmp_path / "train.jsonl", [json.dumps({"prompt": f"p{i}"}) for i in range(20)])
    evals = _write(tmp_path / "eval.jsonl", [json.dumps({"prompt": "e"})])
    t, e = load_train_eval(DataConfig(train_prompts=str(train), eval_prompts=str(evals), max_train_prompts=5))
    assert [r["prompt"] for r in t] == [f"p{i}" for i in range(5)] and e == [{"prompt": "e"}]
    t, e = load_train_eval(DataConfig(train_prompts=str(train), eval_split=0.1))
    assert len(t) == 18 and len(e) == 2
    with pytest.raises(ValueError, match="eval_split is 0"):
        load_train_eval(DataConfig(train_prompts=str(train), eval_split=0.0))


SHAREGPT = {
    "id": "c1",
    "conversations": [
        {"from": "system", "value": "Be terse."},
        {"from": "human", "value": "hello"},
        {"from": "gpt", "value": "world"},
        {"from": "human", "value": "again"},
        {"from": "gpt", "value": "earth"},
    ],
}


def test_sharegpt_rows_read_as_messages_one_prompt_per_assistant_turn(tmp_path):
    """ShareGPT (`conversations`, from/value) trains with no conversion: each assistant turn is a prompt of its own
    (the conversation up to it), in the bench and in training alike."""
    from decode.prompts import encode_prompts, expand_turns, load_prompts

    f = _write(tmp_path / "chats.jsonl", [json.dumps(SHAREGPT), json.dumps({"prompt": "def f(x):"})])
    rows = read_jsonl(f)
    assert rows[0]["messages"][:3] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
    ]
    assert "conversations" not in rows[0] and rows[0]["id"] == "c1"
    turns = expand_turns(rows)
    assert [r.get("id") for r in turns] == ["c1-turn1", "c1-turn2", None]
    assert [len(r["messages"]) for r in turns[:2]] == [3, 5]
    tok = tiny_tokenizer(chat=True)
    # each turn's prompt ends where that assistant turn starts; its reference completion is that turn
    assert render_prompt(turns[0], tok)[0] == "<s><|system|>Be terse.<|end|><|user|>hello<|end|><|assistant|>"
    assert render_prompt(turns[1], tok)[0].endswith("<|assistant|>world<|end|><|user|>again<|end|><|assistant|>")
    assert [render_completion(r, tok) for r in turns[:2]] == ["world<|end|>", "earth<|end|>"]
    bench = load_prompts(f, tokenizer=tok)
    assert [r["id"] for r in bench] == ["c1-turn1", "c1-turn2", "chats-2"]
    other = _write(tmp_path / "eval.jsonl", [json.dumps({"prompt": "hello world"})])
    cfg = DataConfig(train_prompts=str(f), eval_prompts=str(other))
    train, _ = prompt_gen.load_train_eval(cfg, None, tok, target_name="t", cache_dir=tmp_path, seed=0)
    assert [r.get("id") for r in train] == ["c1-turn1", "c1-turn2", None]
    assert encode_prompts(tok, bench) == [e.prompt_ids for e in encode_examples(train, tok, DataConfig())]


def test_conversation_with_a_trailing_user_turn_and_openai_messages():
    """A multi-turn `messages` row (OpenAI style) expands the same way; a conversation ending with a user turn
    keeps that last prompt too (a traffic log's open question); single-turn rows are left as they are."""
    from decode.prompts import expand_turns

    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    turns = expand_turns([{"messages": chat}, {"messages": chat[:2]}, {"prompt": "x"}])
    assert [len(r["messages"]) for r in turns[:2]] == [2, 3]
    assert turns[2:] == [{"messages": chat[:2]}, {"prompt": "x"}]


@pytest.mark.parametrize(
    "row,match",
    [
        ({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]},
         r"chats.jsonl:1: unknown speaker\(s\) \('from'\) 'bot' \(known: human, user, gpt"),
        ({"conversations": [{"from": "human", "text": "hi"}]}, r"conversations\[0\] must be an object with string"),
        ({"conversations": []}, r"'conversations' must be a non-empty list"),
        ({"messages": [{"role": "narrator", "content": "x"}, {"role": "critic", "content": "y"}]},
         r"unknown role\(s\) 'critic', 'narrator' \(known: system, developer, user, assistant, tool\)"),
    ],
    ids=["unknown-speaker", "no-value", "empty", "unknown-role"],
)  # fmt: skip
def test_bad_conversations_are_one_line_naming_what_was_found(tmp_path, row, match):
    f = _write(tmp_path / "chats.jsonl", [json.dumps(row)])
    with pytest.raises(ValueError, match=match) as e:
        read_jsonl(f)
    assert "\n" not in str(e.value)


def test_sharegpt_dataset_rows(tmp_path):
    """A `datasets` table in ShareGPT form (as many Hub conversation sets are) loads the same way."""
    import datasets

    datasets.Dataset.from_list([SHAREGPT, SHAREGPT | {"id": "c2"}]).save_to_disk(str(tmp_path / "ds"))
    rows = load_rows(str(tmp_path / "ds"))
    assert [m["role"] for m in rows[1]["messages"]] == ["system", "user", "assistant", "user", "assistant"]


@pytest.mark.shared
def test_reference_prompt_sets_load():
    t, e = load_train_eval(DataConfig(train_prompts=str(TRAIN_PROMPTS), eval_prompts=str(DEV_PROMPTS)))
    assert len(t) == 4000 and len(e) == 200
    assert all("prompt" in r and "id" in r for r in t[:10])


# ---------------------------------------------------------------- rendering, tokenisation, truncation


def test_chat_template_applied_with_generation_prompt():
    tok = tiny_tokenizer(chat=True)
    row = {
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "world"},
        ]
    }
    text, templated = render_prompt(row, tok)
    assert templated and text == "<s><|user|>hello<|end|><|assistant|>"  # the final assistant turn is not prompt
    assert render_completion(row, tok) == "world<|end|>"  # end-of-turn included
    ex = encode_examples([row], tok, DataConfig(), completion_field="completion")[0]
    assert tok.decode(ex.prompt_ids) == text  # no second BOS from add_special_tokens
    assert ex.completion_ids[-1] == tok.convert_tokens_to_ids("<|end|>")
    # no template, or apply_chat_template off: plain contents
    plain, templated = render_prompt(row, tiny_tokenizer())
    assert not templated and plain == "hello\n\n"
    assert render_prompt(row, tok, apply_chat_template=False)[0] == "hello\n\n"


def test_bench_and_training_encode_a_prompt_file_identically(tmp_path):
    """One pipeline: the bench measures a draft on exactly the prompt tokens training conditions it on."""
    from decode.prompts import encode_prompts, load_prompts

    f = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "def f(x):"}),
            json.dumps(
                {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}
            ),
        ],
    )
    tok = tiny_tokenizer(bos=True, chat=True)
    bench_ids = encode_prompts(tok, load_prompts(f, tokenizer=tok))
    train_ids = [e.prompt_ids for e in encode_examples(read_jsonl(f), tok, DataConfig())]
    assert bench_ids == train_ids
    # The reference answer of a chat row is never part of the bench's prompt either.
    assert tok.decode(bench_ids[1]) == "<s><|user|>hello<|end|><|assistant|>"
    assert bench_ids[0][0] == tok.bos_token_id and bench_ids[1].count(tok.bos_token_id) == 1


def test_raw_prompt_with_completion_field():
    tok = tiny_tokenizer()
    rows = [{"prompt": "def f(x):", "answer": "\n    return x"}, {"prompt": "hello"}]
    with pytest.raises(ValueError, match="row 1 has no 'answer' field"):
        encode_examples(rows, tok, DataConfig(), completion_field="answer")
    ex = encode_examples(rows[:1], tok, DataConfig(), max_new_tokens=2, completion_field="answer")[0]
    assert ex.completion_ids == tok("\n    return x", add_special_tokens=False)["input_ids"][:2]
    assert ex.row is rows[0] and ex.index == 0


def test_left_truncation_keeps_the_end_and_bos():
    tok = tiny_tokenizer()
    text = "the quick brown fox " * 10
    full = tok(text)["input_ids"]
    ex = encode_examples([{"prompt": text}], tok, DataConfig(max_prompt_tokens=7))[0]
    assert ex.prompt_ids == full[-7:]
    btok = tiny_tokenizer(bos=True)
    bfull = btok(text)["input_ids"]
    assert bfull[0] == btok.bos_token_id
    ex = encode_examples([{"prompt": text}], btok, DataConfig(max_prompt_tokens=7))[0]
    assert ex.prompt_ids == [btok.bos_token_id, *bfull[-6:]]


def test_prompt_cut_to_fit_context(caplog):
    tok = tiny_tokenizer()
    text = "the quick brown fox " * 10
    with caplog.at_level(logging.WARNING, logger="distill.data.prompts"):
        ex = encode_examples([{"prompt": text}], tok, DataConfig(max_prompt_tokens=192), 20, 15)[0]
    assert ex.prompt_ids == tok(text)["input_ids"][-5:]  # context 20 - 15 new tokens
    assert "instead of data.max_prompt_tokens" in caplog.text
    with pytest.raises(ValueError, match="max_new_tokens=20 leaves no room"):
        encode_examples([{"prompt": text}], tok, DataConfig(), 20, 20)


def test_empty_rows_dropped_with_warning(caplog):
    tok = tiny_tokenizer()
    rows = [{"prompt": "hello"}, {"prompt": ""}, {"prompt": "world"}]
    with caplog.at_level(logging.WARNING, logger="distill.data.prompts"):
        examples = encode_examples(rows, tok, DataConfig())
    assert [e.index for e in examples] == [0, 2]  # indices stay those of the prompt set
    assert "dropped 1 prompt rows" in caplog.text
    with pytest.raises(ValueError, match="none of the 1 prompt rows"):
        encode_examples([{"prompt": ""}], tok, DataConfig())


# ---------------------------------------------------------------- collation


def test_collate_prompts_left_pads():
    batch = collate_prompts([[5, 6, 7], [8]], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError):
        collate_prompts([[1], []], 0)


def test_collate_training_masks_from_lengths_not_ids():
    # pad == eos == 0, and the first completion ends with a generated EOS (0): it must stay in the loss
    pairs = [([5, 6, 7], [8, 9, 0]), ([5], [0, 4])]
    batch = collate_training(pairs, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [5, 0, 4, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]
    # the shift: the logits at loss_mask positions predict exactly the completion tokens, in order
    for b, (_, completion) in enumerate(pairs):
        t = batch["loss_mask"][b].nonzero().squeeze(1)
        assert batch["input_ids"][b, t + 1].tolist() == completion
    with pytest.raises(ValueError, match="pair 1 has an empty completion"):
        collate_training([([1], [2]), ([1], [])], 0)


def test_collate_training_all_positions_covers_prompt_and_completion_but_never_padding():
    pairs = [([5, 6, 7], [8, 9, 0]), ([5], [0, 4])]
    batch = collate_training(pairs, pad_token_id=0, loss_positions="all")
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]
    for b, (prompt, completion) in enumerate(pairs):
        t = batch["loss_mask"][b].nonzero().squeeze(1)
        assert batch["input_ids"][b, t + 1].tolist() == (prompt + completion)[1:]
    # the default is unchanged: completion tokens only
    assert collate_training(pairs, 0)["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="loss_positions 'prompt' is not one of completion, all"):
        collate_training(pairs, 0, loss_positions="prompt")


def test_training_batch_gives_the_unpadded_loss():
    """Right padding leaves positions alone: a padded row's masked logits equal its unpadded forward's."""
    model = tiny_llama(32, seed=0, special_id=None)
    pairs = [([3, 4, 5, 6], [7, 0, 9]), ([3], [0])]
    batch = collate_training(pairs, pad_token_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        for b, (p, c) in enumerate(pairs):
            alone = model(input_ids=torch.tensor([p + c])).logits[0]
            mask = batch["loss_mask"][b].bool()
            torch.testing.assert_close(logits[b][mask], alone[len(p) - 1 : len(p) + len(c) - 1], rtol=1e-4, atol=1e-5)
