"""Data sources (jsonl, json, parquet, datasets load_from_disk, synthetic) and formats with their loss masks."""
from __future__ import annotations

import json
import statistics
import warnings

import pytest

from novatune.data.dataset import build_data, tokenize_records
from novatune.data.formats import detect_format, make_tokenize
from novatune.data.sources import DataError, load_source, synthetic_docs
from novatune.train.config import DataConfig, SourceConfig
from novatune.train.demo import CHATML_TEMPLATE, load_demo_tokenizer

RECORDS = [{"text": f"record number {i}"} for i in range(7)]


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


def _write(tmp_path, kind):
    if kind == "jsonl":
        p = tmp_path / "d.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + "\n")
    elif kind == "json":
        p = tmp_path / "d.json"
        p.write_text(json.dumps(RECORDS))
    elif kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        p = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(RECORDS), p)
    elif kind in ("datasets", "datasets_dict"):
        datasets = pytest.importorskip("datasets")
        ds = datasets.Dataset.from_list(RECORDS)
        p = tmp_path / kind
        (datasets.DatasetDict({"train": ds}) if kind == "datasets_dict" else ds).save_to_disk(str(p))
    elif kind == "dir":
        p = tmp_path / "shards"
        p.mkdir()
        for i in range(0, 7, 3):
            (p / f"part{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[i:i + 3]))
    return p


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "datasets", "datasets_dict", "dir"])
def test_sources_read_the_same_records(tmp_path, kind):
    p = _write(tmp_path, kind)
    recs = load_source(SourceConfig(path=str(p)))
    assert [r["text"] for r in recs] == [r["text"] for r in RECORDS]
    assert len(load_source(SourceConfig(path=str(p), limit=3))) == 3


def test_datasets_type_reads_local_files(tmp_path):
    pytest.importorskip("datasets")
    for kind in ("jsonl", "parquet"):
        p = _write(tmp_path, kind)
        recs = load_source(SourceConfig(path=str(p), type="datasets"))
        assert [r["text"] for r in recs] == [r["text"] for r in RECORDS]


def test_source_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_source(SourceConfig(path=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        load_source(SourceConfig(path=str(bad)))
    weird = tmp_path / "d.csv"
    weird.write_text("a,b\n")
    with pytest.raises(DataError, match="set type"):
        load_source(SourceConfig(path=str(weird)))
    ds = _write(tmp_path, "datasets_dict")
    with pytest.raises(DataError, match="no split 'test'"):
        load_source(SourceConfig(path=str(ds), split="test"))


def test_synthetic_lengths_are_seeded_lognormal():
    a = list(synthetic_docs(400, vocab_size=1000, median_length=600, sigma=0.7, min_length=32, seed=1))
    b = list(synthetic_docs(400, vocab_size=1000, median_length=600, sigma=0.7, min_length=32, seed=1))
    assert a == b
    lens = [len(d["input_ids"]) for d in a]
    assert 500 < statistics.median(lens) < 720 and min(lens) >= 32
    assert max(max(d["input_ids"]) for d in a) < 1000


def test_detect_format():
    assert detect_format({"messages": []}) == "messages"
    assert detect_format({"prompt": "a", "completion": "b"}) == "prompt_completion"
    assert detect_format({"instruction": "a", "input": "", "output": "b"}) == "alpaca"
    assert detect_format({"text": "a"}) == "text"
    with pytest.raises(DataError, match="data.format"):
        detect_format({"question": "a"})


def _trained_text(tok, doc):
    ids, mask = doc
    return tok.decode([t for t, m in zip(ids, mask) if m])


def test_text_format_all_tokens_plus_eos(tok):
    ids, mask = make_tokenize("text", tok)({"text": "Ava has 3 apples."})
    assert ids[-1] == tok.eos_token_id and all(mask)


@pytest.mark.parametrize("fmt,rec", [
    ("prompt_completion", {"prompt": "What is 2 + 3? ", "completion": "2 + 3 = 5."}),
    ("alpaca", {"instruction": "Add the numbers.", "input": "2 and 3", "output": "2 + 3 = 5."}),
])
def test_completion_only(tok, fmt, rec):
    doc = make_tokenize(fmt, tok, loss_on="completion")(rec)
    assert _trained_text(tok, doc) == "2 + 3 = 5.<|im_end|>"
    full = make_tokenize(fmt, tok, loss_on="all")(rec)
    assert full[0] == doc[0] and all(full[1])


CHAT = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Ava has 3 apples and gets 4 more. How many?"},
    {"role": "assistant", "content": "3 + 4 = 7. The answer is 7."},
    {"role": "user", "content": "And with 2 more?"},
    {"role": "assistant", "content": "7 + 2 = 9."},
]}
PLAIN_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("template", [None, PLAIN_CHATML], ids=["shipped-template", "no-generation-markers"])
def test_assistant_only_mask(tok, template):
    ids, mask = make_tokenize("messages", tok, loss_on="assistant", chat_template=template)(CHAT)
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    # exactly the two assistant turns (each with its end-of-turn marker) carry a loss
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    spans += [tok.decode(cur)] if cur else []
    assert [s.strip() for s in spans] == ["3 + 4 = 7. The answer is 7.<|im_end|>", "7 + 2 = 9.<|im_end|>"]
    # HF's own {% generation %} mask agrees on the shipped template
    if template is None:
        hf = tok.apply_chat_template(CHAT["messages"], tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True, chat_template=CHATML_TEMPLATE)
        assert hf["input_ids"] == ids
        hf_mask = [bool(x) for x in hf["assistant_masks"]]
        assert [m for m, t in zip(mask, ids) if tok.decode([t]) != "\n"] == \
            [m for m, t in zip(hf_mask, ids) if tok.decode([t]) != "\n"]


def test_loss_on_mismatch_and_bad_records(tok):
    with pytest.raises(DataError, match="data.loss_on"):
        tokenize_records([{"text": "x"}], "auto", tok, "assistant", None, True, "data.sources[0]")
    with pytest.raises(DataError, match="lacks 'completion'"):
        tokenize_records([{"prompt": "x", "text": "y"}], "prompt_completion", tok, "all", None, True, "k")


@pytest.mark.parametrize("messages,role", [
    ([{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}], "bot"),
    ([{"role": "user", "content": "Hi"}, {"role": "Assistant", "content": "Hello"}], "Assistant"),
    ([{"from": "human", "value": "Hi"}, {"from": "model", "value": "Hello"}], "model"),
])
def test_unknown_chat_role_names_the_role_and_the_accepted_ones(tok, messages, role):
    with pytest.raises(DataError, match=rf"k: record 0: message 1 has role '{role}'.*system, user, assistant, tool"):
        tokenize_records([{"messages": messages}], "messages", tok, "assistant", CHATML_TEMPLATE, True, "k")


def test_build_data_mixes_sources_and_checks_vocab(tmp_path, tok):
    p = _write(tmp_path, "jsonl")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps(CHAT) + "\n")
    dcfg = DataConfig(sources=[SourceConfig(path=str(chat))], format="auto", loss_on="assistant", max_length=128)
    data = build_data(dcfg, tok, vocab_size=len(tok))
    assert data.formats == ["messages"] and data.stats.docs == 1
    dcfg = DataConfig(sources=[SourceConfig(path=str(p)), SourceConfig(type="synthetic", num_docs=5,
                                                                       median_length=20, min_length=4)],
                      max_length=64)
    data = build_data(dcfg, tok, vocab_size=len(tok))
    assert data.formats == ["text", "tokens"] and data.stats.docs == 12
    with pytest.raises(DataError, match="vocab_size"):
        build_data(DataConfig(sources=[SourceConfig(path=str(p))], max_length=64), tok, vocab_size=10)


def test_non_utf8_jsonl_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not UTF-8 text \(byte 0xe9"):
        list(load_source(SourceConfig(path=str(p))))


def test_null_chat_content_is_a_data_error(tok):
    f = make_tokenize("messages", tok, "assistant", CHATML_TEMPLATE)
    with pytest.raises(DataError, match="message 1 \\(assistant\\) has content None"):
        f({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]})


@pytest.mark.parametrize("record,match", [({"input_ids": [1, -2, 3]}, "entry -2"),
                                          ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "2 labels for 3 input_ids"),
                                          ({"input_ids": [10, 11, 12], "labels": [-100, 21, 22]},
                                           r"labels\[1\] = 21 where input_ids\[1\] = 11")])
def test_bad_token_records_fail_at_load(record, match):
    """Labels other than the token itself or -100 (shifted labels, another target) were read as a mask only: the
    model trained on input_ids, silently."""
    with pytest.raises(DataError, match=match):
        make_tokenize("tokens", None)(record)
    assert make_tokenize("tokens", None)({"input_ids": [4, 5, 6], "labels": [-100, 5, 6]}) == \
        ([4, 5, 6], [False, True, True])


@pytest.mark.parametrize("name,kind,match", [("x.jsonl", "parquet", "not a readable Parquet file"),
                                             ("x.parquet", "auto", "not a readable Parquet file"),
                                             ("x.jsonl", "json", "set type: jsonl")])
def test_wrong_or_corrupt_file_types_are_data_errors(tmp_path, name, kind, match):
    pytest.importorskip("pyarrow")
    p = tmp_path / name
    p.write_text('{"text": "a"}\n{"text": "b"}\n')  # JSON lines, whatever the name says
    with pytest.raises(DataError, match=match):
        load_source(SourceConfig(path=str(p), type=kind))


def test_broken_inline_chat_template_is_a_data_error(tok):
    f = make_tokenize("messages", tok, "assistant", "{% for m in messages %}{{ m.content }")
    with pytest.raises(DataError, match="data.chat_template: the chat template fails to render: TemplateSyntaxError"):
        f({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})


def test_conversational_prompt_completion_goes_through_the_chat_template(tok):
    """TRL's conversational prompt/completion (two lists of messages): the chat template renders prompt +
    completion, and loss_on completion trains what follows the prompt's generation prompt. Before, str() of each
    list trained on its Python repr."""
    rec = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}],
           "completion": [{"role": "assistant", "content": "4"}]}
    ids, mask = make_tokenize("prompt_completion", tok, loss_on="completion")(rec)
    whole = tok.apply_chat_template(rec["prompt"] + rec["completion"], tokenize=False)
    assert tok.decode(ids) == whole and "'role'" not in tok.decode(ids)
    assert _trained_text(tok, (ids, mask)).strip() == "4<|im_end|>"
    assert all(make_tokenize("prompt_completion", tok, loss_on="all")(rec)[1])


@pytest.mark.parametrize("fmt,rec,field", [
    ("text", {"text": ["a", "b"]}, "text"),
    ("prompt_completion", {"prompt": "2 + 2 =", "completion": 4}, "completion"),
    ("prompt_completion", {"prompt": [{"role": "user", "content": "hi"}], "completion": "hello"}, "prompt"),
    ("alpaca", {"instruction": "Add.", "input": ["2", "3"], "output": "5"}, "input"),
])
def test_a_text_field_that_is_not_text_is_a_data_error(tok, fmt, rec, field):
    with pytest.raises(DataError, match=f"'{field}' of type"):
        make_tokenize(fmt, tok, loss_on="all")(rec)


TOOL_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
                 "{% for c in m.get('tool_calls', []) %}{{ 'CALL ' + c['function']['name'] }}{% endfor %}"
                 "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")


def test_tool_calls_reach_the_chat_template_and_are_trained(tok):
    """A message's other keys (tool_calls, reasoning_content, name, ...) go to the template; an assistant turn
    that only calls a tool (content null) trains on the call. Before, only role and content were kept: the call
    trained as an empty answer."""
    rec = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                        {"role": "assistant", "content": None,
                         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                        {"role": "tool", "content": "12 C", "name": "get_weather"},
                        {"role": "assistant", "content": "It is 12 C."}]}
    ids, mask = make_tokenize("messages", tok, loss_on="assistant", chat_template=TOOL_TEMPLATE)(rec)
    trained = _trained_text(tok, (ids, mask))
    assert "CALL get_weather" in trained and "It is 12 C." in trained and "Oslo" not in trained


def test_a_folder_is_split_by_its_file_names(tmp_path):
    """train.jsonl and test.jsonl in one folder: split: picks the files (train by default), as datasets reads a
    data folder. Before, every file was read whatever split said, test rows first."""
    folder = tmp_path / "splits"
    folder.mkdir()
    for split, n in (("train", 3), ("test", 2)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"{split} {i}"}) + "\n" for i in range(n)))
    train = load_source(SourceConfig(path=str(folder)))
    assert [r["text"] for r in train] == ["train 0", "train 1", "train 2"]
    assert [r["text"] for r in load_source(SourceConfig(path=str(folder), split="test"))] == ["test 0", "test 1"]
    with pytest.raises(DataError, match="no validation files"):
        load_source(SourceConfig(path=str(folder), split="validation"))
    (folder / "extra.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError, match="extra.jsonl do not"):
        load_source(SourceConfig(path=str(folder)))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    assert len(load_source(SourceConfig(path=str(plain)))) == 1
    with pytest.raises(DataError, match="no file name says a split"):
        load_source(SourceConfig(path=str(plain), split="test"))


def test_a_saved_dataset_without_splits_refuses_another_split(tmp_path):
    p = _write(tmp_path, "datasets")
    assert len(load_source(SourceConfig(path=str(p)))) == len(RECORDS)
    with pytest.raises(DataError, match="has no split 'test'"):
        load_source(SourceConfig(path=str(p), split="test"))


def test_csv_columns_stay_text(tmp_path):
    """Through `datasets`, a CSV completion "007" stays "007" (type inference made it 7.0)."""
    pytest.importorskip("datasets")
    p = tmp_path / "d.csv"
    p.write_text('prompt,completion\n"Agent number?",007\n"Price?",1.50\n')
    recs = load_source(SourceConfig(path=str(p), type="datasets"))
    assert [r["completion"] for r in recs] == ["007", "1.50"]


def test_a_byte_order_mark_opens_a_file_without_error(tmp_path):
    for name, body in (("b.jsonl", json.dumps({"text": "hi"}) + "\n"), ("b.json", json.dumps([{"text": "hi"}]))):
        p = tmp_path / name
        p.write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert load_source(SourceConfig(path=str(p))) == [{"text": "hi"}]


def test_conversational_assistant_only_trains_the_completions_assistant_turns_not_a_tool_output(tok):
    rec = {"prompt": [{"role": "user", "content": "Weather?"}],
           "completion": [{"role": "assistant", "content": "calling"}, {"role": "tool", "content": "SECRET 12 C"},
                          {"role": "assistant", "content": "It is 12 C."}]}
    trained = _trained_text(tok, make_tokenize("prompt_completion", tok, loss_on="assistant")(rec))
    assert "calling" in trained and "It is 12 C." in trained and "SECRET" not in trained
    everything = _trained_text(tok, make_tokenize("prompt_completion", tok, loss_on="completion")(rec))
    assert "SECRET" in everything and "Weather" not in everything


def test_tool_call_arguments_given_as_a_json_string_reach_the_template_as_a_dict_and_none_keys_are_dropped():
    from novatune.data.formats import _normalise_messages

    msgs = _normalise_messages([
        {"role": "assistant", "content": None, "reasoning_content": None,
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "user", "content": "x", "tool_calls": None, "name": None}])
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and "reasoning_content" not in msgs[0]
    assert msgs[1] == {"role": "user", "content": "x"}


def test_split_names_with_digits_and_csv_folders(tmp_path):
    """train0 / test1 name their splits (digits separate words, as in datasets); a folder of CSV files reads
    through type: datasets with every column as text and "N/A" kept as text."""
    folder = tmp_path / "csvs"
    folder.mkdir()
    (folder / "train0.csv").write_text('prompt,completion\n"Agent?",007\n"Missing?",N/A\n')
    (folder / "test1.csv").write_text('prompt,completion\n"Test?",1\n')
    pytest.importorskip("datasets")
    train = load_source(SourceConfig(path=str(folder), type="datasets"))
    assert [r["completion"] for r in train] == ["007", "N/A"]
    assert [r["prompt"] for r in load_source(SourceConfig(path=str(folder), type="datasets", split="test"))] == \
        ["Test?"]


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A tokenizer that prefixes every encoded text with "▁" (SentencePiece's dummy prefix, as Llama 2, Mistral
    and Gemma tokenizers do), trained here on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.Unigram())
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    t.train_from_iterator(["What is two plus three? The answer is five.", "Answer: four. Answer: five."] * 20,
                          trainers.UnigramTrainer(vocab_size=120, special_tokens=["<s>", "</s>", "<unk>"],
                                                  unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("prompt,completion", [("The answer is five", "."),
                                               ("What is two plus three? The answer is", " five.")])
def test_prompt_completion_is_tokenised_whole_as_trl_does(sentencepiece_like, prompt, completion):
    """The pair is the tokens of prompt + completion as one text (what the model reads at inference, and TRL's
    SFTTrainer's input_ids); encoding the completion alone put a "▁" before "." that the text does not have."""
    tok = sentencepiece_like
    ids, mask = make_tokenize("prompt_completion", tok, loss_on="completion")({"prompt": prompt,
                                                                              "completion": completion})
    assert ids == tok(prompt + completion)["input_ids"] + [tok.eos_token_id]
    prompt_ids = tok(prompt)["input_ids"]
    assert mask == [False] * len(prompt_ids) + [True] * (len(ids) - len(prompt_ids))
    assert tok.decode(ids[len(prompt_ids):]) == tok.decode(tok(prompt + completion)["input_ids"][len(prompt_ids):]
                                                           + [tok.eos_token_id])


def test_a_prompt_that_merges_into_the_completion_warns_and_trains_from_where_they_part(sentencepiece_like):
    tok = sentencepiece_like
    # the prompt's trailing space is its own "▁" alone, and part of "▁f" in the whole text
    prompt, completion = "What is two plus three? The answer is ", "five."
    whole = tok(prompt + completion)["input_ids"]
    part = next(i for i, (a, b) in enumerate(zip(tok(prompt)["input_ids"], whole)) if a != b)
    tokenize = make_tokenize("prompt_completion", tok, loss_on="completion")
    with pytest.warns(UserWarning, match="not a prefix"):
        ids, mask = tokenize({"prompt": prompt, "completion": completion})
    assert ids == whole + [tok.eos_token_id]
    assert mask == [False] * part + [True] * (len(ids) - part)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per data source: the next such record is quiet
        tokenize({"prompt": "What is two plus three? The answer is ", "completion": "four."})


def test_prompt_completion_with_a_bos_tokenizer_alpaca_and_loss_on_all(tok):
    """The demo tokenizer's own case (no BOS), alpaca's prompt, and loss_on all: one text, every token trained."""
    import copy

    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    backend = copy.deepcopy(tok.backend_tokenizer)  # the module's demo tokenizer stays as it is
    start = ("<|im_start|>", tok.convert_tokens_to_ids("<|im_start|>"))
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[start])
    bos = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token=tok.eos_token)
    ids, mask = make_tokenize("prompt_completion", bos, loss_on="completion")({"prompt": "Q? ", "completion": "A."})
    assert ids == bos("Q? A.")["input_ids"] + [bos.eos_token_id] and ids[0] == bos.bos_token_id
    assert mask == [False] * len(bos("Q? ")["input_ids"]) + [True] * (len(ids) - len(bos("Q? ")["input_ids"]))
    rec = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "2 + 3 = 5."}
    ids, mask = make_tokenize("alpaca", bos, loss_on="all")(rec)
    assert all(mask) and ids[-1] == bos.eos_token_id and ids[0] == bos.bos_token_id
