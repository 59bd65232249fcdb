"""Chat templates and trained tokens (`zephon_stream.chat`), checked against `transformers`.

For each public template format (ChatML, Llama 3, Llama 2 with its system prompt, Qwen 2.5's
default system prompt), with and without `{% generation %}` markers, the token ids and trained
flags equal `transformers`' `apply_chat_template(..., return_assistant_tokens_mask=True)` on the
marked template, exactly: on the Python FAQ's questions and answers and on generated
conversations. `transformers` is only a test dependency; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._chat_data import (
    CHATML,
    CHATML_GEN,
    CHATML_PARTS,
    CHATML_PARTS_GEN,
    LLAMA2,
    QWEN_TOOLS,
    QWEN_TOOLS_GEN,
    TEMPLATES,
    faq_conversations,
    tool_conversations,
    train_tokenizer,
    word_conversations,
)
from tests.core.conftest import make_docs
from zephon_stream.chat import FIXED_NOW, ROLES, ChatTemplate, ChatTokens, load_template, token_mask
from zephon_stream.errors import ConfigError, DataError
from zephon_stream.operators.read import BadRecords
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.operators.types import Conversation

REF = (0, 0, 0, 1)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import random

    return train_tokenizer(tmp_path_factory.mktemp("chat") / "tokenizer.json", make_docs(random.Random(5), 400, 40))


def _tokens(path: Path, name: str, marked: bool, loss_on: str = "assistant") -> ChatTokens:
    plain, gen, eos, bos = TEMPLATES[name]
    template = ChatTemplate(gen if marked else plain, name, {"eos_token": eos, "bos_token": bos})
    return ChatTokens(template, Tokenize(str(path), eos, bos), loss_on)


def _reference(path: Path, name: str, conversations: list[list[dict[str, Any]]]) -> list[tuple[list[int], list[int]]]:
    """`transformers`' ids and assistant mask of each conversation, on the marked template."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    _, gen, eos, bos = TEMPLATES[name]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)), eos_token=eos,
                                              bos_token=bos)
    out = []
    for conv in conversations:
        got = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     chat_template=gen)
        out.append((list(got["input_ids"]), list(got["assistant_masks"])))
    return out


def _expected(tok: Tokenize, ids: list[int], mask: list[int], all_trained: bool = False) -> tuple[list[int], list[int]]:
    """The document the loader makes of a render's ids: BOS first unless there, EOS last unless there."""
    head = [tok.bos_id] if tok.bos_id is not None and ids[:1] != [tok.bos_id] else []
    tail = [] if ids[-1:] == [tok.eos_id] else [tok.eos_id]
    return head + ids + tail, [0] * len(head) + mask + [int(all_trained)] * len(tail)


def _check_equal(tokens: ChatTokens, path: Path, name: str, conversations: list[list[dict[str, Any]]]) -> int:
    docs = tokens([(REF, c) for c in conversations], BadRecords(), "test.jsonl")
    assert len(docs) == len(conversations)
    trained = 0
    for (_, doc), (ids, mask) in zip(docs, _reference(path, name, conversations)):
        want_ids, want_mask = _expected(tokens.tokenizer, ids, mask)
        assert doc.ids.tolist() == want_ids
        assert doc.trained.astype(int).tolist() == want_mask
        trained += int(doc.trained.sum())
    return trained


@pytest.mark.parametrize("marked", [False, True], ids=["prefix-renders", "generation-markers"])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_python_faq_matches_transformers(tokenizer_path, name, marked):
    conversations = faq_conversations()
    if name == "llama2":  # its roles must alternate after the system prompt: they do
        assert all(m["role"] == ("user", "assistant")[i % 2] for c in conversations for i, m in enumerate(c[1:]))
    assert _check_equal(_tokens(tokenizer_path, name, marked), tokenizer_path, name, conversations) > 10_000


@pytest.mark.parametrize("marked", [False, True], ids=["prefix-renders", "generation-markers"])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_generated_conversations_match_transformers(tokenizer_path, name, marked):
    conversations = word_conversations(seed=len(name), n=60)
    assert _check_equal(_tokens(tokenizer_path, name, marked), tokenizer_path, name, conversations) > 0


@pytest.mark.parametrize("marked", [False, True], ids=["prefix-renders", "generation-markers"])
def test_tool_use_matches_transformers(tokenizer_path, marked):
    """Qwen 2.5's tool template: tools in the system prompt, calls with null, absent or real content,
    results in a row. Trained: each assistant message's content, calls and end of turn, as
    `transformers` marks them on the marked template (given the tools as `tools=`)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    pairs = tool_conversations(seed=3, n=120)
    assert any(m.get("content") is None and m["role"] == "assistant" for c, _ in pairs for m in c)
    plain, gen = ChatTemplate(QWEN_TOOLS, "qwen-tools"), ChatTemplate(QWEN_TOOLS_GEN, "qwen-tools-gen")
    assert all(plain.render(c, t) == gen.render(c, t) for c, t in pairs)  # the marks change no text
    tok = Tokenize(str(tokenizer_path), "<|endoftext|>")
    tokens = ChatTokens(gen if marked else plain, tok, "assistant")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_path)),
                                              eos_token="<|endoftext|>")
    docs = tokens([(REF, Conversation(c, t)) for c, t in pairs], BadRecords(), "test.jsonl")
    assert len(docs) == len(pairs)
    for (_, doc), (conv, tools) in zip(docs, pairs):
        got = hf.apply_chat_template(conv, tools=tools, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True, chat_template=QWEN_TOOLS_GEN)
        want_ids, want_mask = _expected(tok, list(got["input_ids"]), list(got["assistant_masks"]))
        assert doc.ids.tolist() == want_ids
        assert doc.trained.astype(int).tolist() == want_mask
    # a JSON string of the tools is the same tools
    as_json = tokens([(REF, Conversation(c, json.dumps(t))) for c, t in pairs[:20]], None, "k")
    assert [d.ids.tolist() for _, d in as_json] == [d.ids.tolist() for _, d in docs[:20]]


def _as_parts(conversations: list[list[dict[str, Any]]], seed: int) -> list[list[dict[str, Any]]]:
    """Each assistant content (and some others) as a list of 1-3 text parts that join to it."""
    import random

    rng = random.Random(seed)
    out = []
    for conv in conversations:
        new = []
        for m in conv:
            text = m["content"]
            if m["role"] == "assistant" or rng.random() < 0.5:
                cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 2))))
                pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
                new.append({**m, "content": [{"type": "text", "text": p} for p in pieces]})
            else:
                new.append(m)
        out.append(new)
    return out


@pytest.mark.parametrize("marked", [False, True], ids=["prefix-renders", "generation-markers"])
def test_content_as_text_parts_matches_transformers(tokenizer_path, marked):
    """OpenAI-style content, a list of {"type": "text", "text": ...} parts, goes to the template as
    it is (as `transformers` passes it); a template that joins the parts trains what it renders."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    conversations = _as_parts(word_conversations(seed=17, n=80), seed=2)
    assert any(isinstance(m["content"], list) and len(m["content"]) > 1 for c in conversations for m in c)
    tok = Tokenize(str(tokenizer_path), "<|endoftext|>")
    tokens = ChatTokens(ChatTemplate(CHATML_PARTS_GEN if marked else CHATML_PARTS, "chatml-parts"), tok, "assistant")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_path)),
                                              eos_token="<|endoftext|>")
    docs = tokens([(REF, c) for c in conversations], BadRecords(), "test.jsonl")
    assert len(docs) == len(conversations)
    for (_, doc), conv in zip(docs, conversations):
        got = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     chat_template=CHATML_PARTS_GEN)
        want_ids, want_mask = _expected(tok, list(got["input_ids"]), list(got["assistant_masks"]))
        assert doc.ids.tolist() == want_ids and doc.trained.astype(int).tolist() == want_mask
    if marked:
        return  # the marked template's assistant branch takes parts only
    # the same conversations with string contents give the same documents
    plain = [[{**m, "content": "".join(p["text"] for p in m["content"]) if isinstance(m["content"], list)
               else m["content"]} for m in c] for c in conversations]
    assert [d.ids.tolist() for _, d in tokens([(REF, c) for c in plain], None, "k")] == [d.ids.tolist()
                                                                                          for _, d in docs]


@pytest.mark.parametrize("marked", [False, True])
def test_last_assistant_is_the_last_run_of_the_assistant_mask(tokenizer_path, marked):
    conversations = word_conversations(seed=9, n=40, turns=4)
    tokens = _tokens(tokenizer_path, "chatml", marked, "last_assistant")
    tokenizer = tokens.tokenizer
    docs = tokens([(REF, c) for c in conversations], None, "k")
    for (_, doc), (ids, mask) in zip(docs, _reference(tokenizer_path, "chatml", conversations)):
        last = np.array(mask)
        runs = np.flatnonzero(np.diff(np.concatenate([[0], last])) == 1)  # where each run of ones starts
        last[:runs[-1]] = 0
        assert doc.trained.astype(int).tolist() == _expected(tokenizer, ids, last.tolist())[1]


def test_all_trains_every_token_but_bos(tokenizer_path):
    conversations = word_conversations(seed=3, n=20)
    for name in ("chatml", "llama3"):
        tokens = _tokens(tokenizer_path, name, False, "all")
        for (_, doc), (ids, _) in zip(tokens([(REF, c) for c in conversations], None, "k"),
                                      _reference(tokenizer_path, name, conversations)):
            want_ids, _ = _expected(tokens.tokenizer, ids, [1] * len(ids), all_trained=True)
            assert doc.ids.tolist() == want_ids
            bos = tokens.tokenizer.bos_id  # llama3: the template writes it; chatml: none
            assert doc.trained.astype(int).tolist() == [int(not (k == 0 and i == bos)) for k, i in enumerate(want_ids)]


def test_bos_and_eos_are_added_once(tokenizer_path):
    conv = [{"role": "user", "content": "the loader"}, {"role": "assistant", "content": "reads a shard"}]
    tok = Tokenize(str(tokenizer_path), "</s>", "<s>")
    llama2 = ChatTokens(ChatTemplate(LLAMA2, "llama2", {"eos_token": "</s>", "bos_token": "<s>"}), tok, "assistant")
    (_, doc), = llama2([(REF, conv)], None, "k")
    assert doc.ids.tolist().count(tok.bos_id) == 1 and doc.ids[0] == tok.bos_id  # the template's own BOS
    assert doc.ids.tolist().count(tok.eos_id) == 1 and doc.ids[-1] == tok.eos_id  # and its own EOS, trained
    assert doc.trained[-1] and not doc.trained[0]
    chatml = ChatTokens(ChatTemplate(CHATML, "chatml"), tok, "assistant")
    (_, doc), = chatml([(REF, conv)], None, "k")
    assert doc.ids[0] == tok.bos_id and doc.ids[-1] == tok.eos_id  # added: the template writes neither
    assert not doc.trained[0] and not doc.trained[-1]  # the loader's EOS is trained under "all" only
    assert tok.decode(doc.ids[doc.trained].tolist()) == "reads a shard<|im_end|>"


def test_trained_text_is_the_content_and_the_end_of_turn(tokenizer_path):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a lane?"},
            {"role": "assistant", "content": "  a lane reads splits\n"}, {"role": "user", "content": "and?"},
            {"role": "assistant", "content": ""}]
    for name, want in [("chatml", "  a lane reads splits\n<|im_end|><|im_end|>"),
                       ("llama3", "a lane reads splits<|eot_id|><|eot_id|>")]:
        tokens = _tokens(tokenizer_path, name, False)
        text, spans = tokens.template.spans(conv, "assistant")
        assert "".join(text[a:b] for a, b in spans) == want
        assert _tokens(tokenizer_path, name, True).template.spans(conv, "assistant") == (text, spans)


def test_generation_marks_survive_buffered_output(tokenizer_path):
    """A generation block inside a macro: its output is buffered before it is written, which
    would shift recorded indices; marks travel with the text."""
    template = ("{% macro turn(m) %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}</a>"
                "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endmacro %}"
                "{% for m in messages %}{{ turn(m) }}{% endfor %}")
    conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "shard"},
            {"role": "user", "content": "y"}, {"role": "assistant", "content": "lane"}]
    text, spans = ChatTemplate(template).spans(conv, "assistant")
    assert text == "<user>x\n<assistant>shard</a>\n<user>y\n<assistant>lane</a>\n"
    assert [text[a:b] for a, b in spans] == ["shard</a>", "lane</a>"]
    assert ChatTemplate(template).spans(conv, "last_assistant")[1] == spans[-1:]


def test_marks_avoid_characters_in_the_conversation():
    conv = [{"role": "user", "content": "\ue000\ue001"}, {"role": "assistant", "content": "\ue002 ok"}]
    text, spans = ChatTemplate(CHATML_GEN).spans(conv, "assistant")
    assert text == ChatTemplate(CHATML).render(conv)
    assert [text[a:b] for a, b in spans] == ["\ue002 ok<|im_end|>"]
    assert ChatTemplate(CHATML).spans(conv, "assistant") == (text, spans)
    every = [{"role": "user", "content": "".join(map(chr, range(0xE000, 0xF900)))},
             {"role": "assistant", "content": ""}]
    with pytest.raises(DataError, match="every Unicode private-use character"):
        ChatTemplate(CHATML_GEN).spans(every, "assistant")
    assert ChatTemplate(CHATML_GEN).spans(every, "all")[0] == ChatTemplate(CHATML).render(every)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 4)), max_size=20),
       st.lists(st.tuples(st.integers(0, 30), st.integers(0, 6)), max_size=5))
def test_token_mask_is_transformers_single_pass_rule(tokens, spans):
    """token_mask equals the loop of `transformers`' apply_chat_template for sorted tokens and spans."""
    offsets = np.array(sorted((s, s + n) for s, n in tokens), dtype=np.int64).reshape(-1, 2)
    cut, spans_ = 0, []
    for start, n in sorted(spans):  # disjoint, in order, as renders give them
        if start >= cut:
            spans_.append((start, start + n))
            cut = start + n + 1
    want, k = [0] * len(offsets), 0
    for i, (s, e) in enumerate(offsets.tolist()):
        while k < len(spans_) and s >= spans_[k][1]:
            k += 1
        if k == len(spans_):
            break
        if e > spans_[k][0]:
            want[i] = 1
    assert token_mask(offsets, spans_).astype(int).tolist() == want


# ---- refusals and bad input ------------------------------------------------------------------

def test_a_template_whose_prefixes_are_not_prefixes_is_refused():
    closing = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if loop.last %}<end>{% endif %}{% endfor %}"
    conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(DataError, match=r"not incremental.*first 1 messages is not a prefix.*generation"):
        ChatTemplate(closing).spans(conv, "assistant")
    assert ChatTemplate(closing).spans(conv, "all") == ("<user>x<assistant>y<end>", [(0, 24)])


def test_content_the_template_changes_is_trained_as_rendered():
    """A template that renders only part of the content (reasoning dropped, as Qwen 3 does): the
    part between the head and the tail of the turn is trained."""
    think = ("{% for m in messages %}<{{ m.role }}>{% if '</think>' in m.content %}"
             "{{ m.content.split('</think>')[1] }}{% else %}{{ m.content }}{% endif %}<end>{% endfor %}")
    conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>a lane</think>b"}]
    text, spans = ChatTemplate(think).spans(conv, "assistant")
    assert text == "<user>x<end><assistant>b<end>" and [text[a:b] for a, b in spans] == ["b<end>"]


def test_a_turn_whose_surroundings_depend_on_the_content_is_refused():
    tools = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if 'call(' in m.content %}<call>{% else %}"
             "<end>{% endif %}{% endfor %}")
    conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "call(lane)"}]
    with pytest.raises(DataError, match=r"message 1 \(assistant\) in a way its content cannot be found.*generation"):
        ChatTemplate(tools).spans(conv, "assistant")


@pytest.mark.parametrize(("messages", "problem"), [
    ([], "the conversation is empty"),
    ("hello", "the conversation is str 'hello', not a list of messages"),
    ([{"content": "x"}], "message 0 has no role"),
    ([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}],
     "message 1 has role 'robot'; a role is one of system, user, assistant, tool$"),
    ([{"from": "human", "value": "x"}], r"message 0 has no role \(keys: from, value\) \(ShareGPT style: map "
                                        r"from/value to role/content with a map step\)"),
    ([{"role": "user", "content": "x"}, {"role": "gpt", "content": "y"}],
     r"message 1 has role 'gpt'; a role is one of system, user, assistant, tool \('gpt' looks like 'assistant': "
     r"rename the roles with a map step"),
    ([{"role": "user", "content": ["x"]}], r"message 0 \(user\) has content part 0 that is str 'x', not an object "
                                           "with a type"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"message 0 \(user\) has a 'image_url' part: a chat source carries text parts only"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}],
     r"message 0 \(user\) has text part 0 whose text is int 3, not a string"),
    ([{"role": "user", "content": {"text": "x"}}], r"message 0 \(user\) has content that is dict .*, not a string "
                                                   "or a list of text parts"),
    ([{"role": "assistant", "content": None}], r"message 0 \(assistant\) has content that is null"),
    ([{"role": "user"}], r"message 0 \(user\) has no content"),
    (["user: x"], "message 0 is str 'user: x', not an object"),
    ([{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}],
     "raised on its first 1 messages: TemplateError: Conversation roles must alternate"),
])
def test_bad_conversations_are_data_errors_naming_the_shard(tokenizer_path, messages, problem):
    tokens = _tokens(tokenizer_path, "llama2", False)
    with pytest.raises(DataError, match=problem) as info:
        tokens([((0, 3, 4096, 80), messages)], BadRecords(), "sft/part-0.jsonl")
    assert info.value.key == "sft/part-0.jsonl" and info.value.offset == 4096
    assert "bad conversation in 'sft/part-0.jsonl' at byte 4096 of its split: " in str(info.value)
    with pytest.raises(DataError, match=problem) as info:  # the reader says where: here a Parquet row
        tokens([((0, 3, 4096, 80), messages)], BadRecords(), "sft/part-0.parquet", lambda pos: f"row {pos} of group 2")
    assert "bad conversation in 'sft/part-0.parquet' at row 4096 of group 2: " in str(info.value)


def test_bad_conversations_are_skipped_and_counted(tokenizer_path):
    good = word_conversations(seed=1, n=3)
    bad_ones = [[], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}],
                [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]]
    docs = [((0, 0, i, 1), c) for i, c in enumerate(good[:1] + bad_ones + good[1:])]
    skip = BadRecords("skip")
    out = _tokens(tokenizer_path, "llama2", False)(docs, skip.at(2), "k")
    assert [ref[2] for ref, _ in out] == [0, 5, 6]
    assert skip.count == 4 and skip.by_epoch == {2: 4} and "the conversation is empty" in skip.first


def test_a_template_that_raises_anything_is_a_data_error():
    for body, what in [("{{ 1 // 0 }}", "ZeroDivisionError"), ("{{ messages[0].content.nope() }}", "UndefinedError"),
                       ("{{ raise_exception('no tools here') }}", "TemplateError: no tools here")]:
        with pytest.raises(DataError, match=f"raised on the whole conversation: {what}"):
            ChatTemplate(body).render([{"role": "tool", "content": "x"}])


def test_the_sandbox_refuses_python_internals():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(DataError, match="SecurityError|UndefinedError"):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])
    ns = "{% set ns = namespace(_hidden=1) %}{{ ns }}"
    with pytest.raises(DataError, match="SecurityError: .*underscore"):
        ChatTemplate(ns).render([{"role": "user", "content": "x"}])
    with pytest.raises(DataError, match="SecurityError"):  # immutable: a template cannot change the conversation
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])


def test_the_environment_is_the_one_of_transformers():
    t = ChatTemplate("  {% for m in messages %}\n{{ m.content | tojson }}{% break %}{% endfor %}\n"
                     "{{ dict(a=1) | tojson(indent=1) }}|{{ strftime_now('%Y-%m-%d') }}")
    # lstrip_blocks and trim_blocks drop the block lines' whitespace; tojson keeps <, > and non-ASCII
    assert t.render([{"role": "user", "content": "<é>"}, {"role": "user", "content": "2"}]) == \
        f'"<é>"{{\n "a": 1\n}}|{FIXED_NOW:%Y-%m-%d}'
    assert ROLES == ("system", "user", "assistant", "tool")


# ---- loading a template ----------------------------------------------------------------------

def test_template_variables_come_from_where_the_template_does(tmp_path):
    """A template file sees the config's tokens; the template of a tokenizer_config.json sees that
    file's special tokens (the bytes the order digest holds decide the render)."""
    (tmp_path / "t.jinja").write_text("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
    tok = str(tmp_path / "tokenizer.json")
    defaults = {"eos_token": "<eos>", "bos_token": None}
    assert load_template(str(tmp_path / "t.jinja"), tok, defaults=defaults).render(
        [{"role": "user", "content": "x"}]) == "x<eos>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|begin_of_text|>", "special": True}, "eos_token": "<|eot_id|>",
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}]}))
    assert load_template(str(tmp_path / "t.jinja"), tok, defaults=defaults).render(
        [{"role": "user", "content": "x"}]) == "x<eos>"
    assert load_template(None, tok, defaults=defaults).render(
        [{"role": "user", "content": "x"}]) == "<|begin_of_text|>x<|eot_id|>"


@pytest.mark.parametrize("layout", ["files", "config-list"])
def test_a_model_directory_template_is_the_one_transformers_loads(tokenizer_path, tmp_path, layout):
    """A model directory as transformers saves it now: chat_template.jinja (and
    additional_chat_templates/tool_use.jinja) beside a tokenizer_config.json that may hold an older
    template; the files win. Or the older layout, named templates in tokenizer_config.json. A
    conversation offered tools is rendered with the "tool_use" template, as transformers picks it.
    Ids equal those of `AutoTokenizer.from_pretrained(dir).apply_chat_template(conv, tools=...)`."""
    transformers = pytest.importorskip("transformers")
    import shutil

    from zephon_stream.loader.config import Config, SourceConfig

    default = QWEN_TOOLS.replace("helpful assistant", "plain assistant")  # tells the two apart
    assert default != QWEN_TOOLS
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tokenizer_path, model / "tokenizer.json")
    tok_config: dict[str, Any] = {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if layout == "files":
        tok_config["chat_template"] = "OLD {{ messages[0]['content'] }}"  # older than the files: not used
        (model / "chat_template.jinja").write_text(default)
        (model / "additional_chat_templates").mkdir()
        (model / "additional_chat_templates" / "tool_use.jinja").write_text(QWEN_TOOLS)
    else:
        tok_config["chat_template"] = [{"name": "default", "template": default},
                                       {"name": "tool_use", "template": QWEN_TOOLS}]
    (model / "tokenizer_config.json").write_text(json.dumps(tok_config))
    hf = transformers.AutoTokenizer.from_pretrained(str(model))
    template = load_template(None, str(model / "tokenizer.json"))
    assert template.source == default and template.tool_use is not None and template.tool_use.source == QWEN_TOOLS
    tokens = ChatTokens(template, Tokenize(str(model / "tokenizer.json"), "<|endoftext|>"), "all")
    pairs = tool_conversations(seed=8, n=30)
    assert any(t is None for _, t in pairs) and any(t is not None for _, t in pairs)
    docs = tokens([(REF, Conversation(c, t)) for c, t in pairs], None, "k")
    for (_, doc), (conv, tools) in zip(docs, pairs):
        want = list(hf.apply_chat_template(conv, tools=tools, tokenize=True, return_dict=True)["input_ids"])
        assert doc.ids.tolist()[:len(want)] == want
    # the files' bytes are order settings: an edited chat_template.jinja is a new order
    cfg = Config(seed=1, lanes=1, seq_len=8, global_batch_size=1, tokenizer=str(model),
                 sources=[SourceConfig(name="s", uri="file:///x/", messages_field="messages")])
    before = cfg.order_digest("t")
    edited = model / ("chat_template.jinja" if layout == "files" else "tokenizer_config.json")
    edited.write_text(edited.read_text().replace("plain", "other", 1))
    assert cfg.order_digest("t") != before


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(tokenizer_path, tmp_path):
    """`chat_template_kwargs` (gpt-oss's reasoning_effort, SmolLM3's enable_thinking...) are template
    variables, passed last; they round-trip through TOML and are order settings."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from zephon_stream.loader.config import Config, SourceConfig

    effort = ("{{ '<|im_start|>system\\nReasoning: ' + (reasoning_effort | default('medium')) + "
              "(' /no_think' if enable_thinking is defined and not enable_thinking else '') + '<|im_end|>\\n' }}")
    (tmp_path / "t.jinja").write_text(effort + CHATML)
    kwargs = {"reasoning_effort": "high", "enable_thinking": False}
    source = SourceConfig(name="s", uri="file:///x/", messages_field="messages",
                          chat_template=str(tmp_path / "t.jinja"), chat_template_kwargs=kwargs)
    cfg = Config(seed=1, lanes=1, seq_len=8, global_batch_size=1, tokenizer=str(tokenizer_path), sources=[source])
    (tmp_path / "c.toml").write_text(cfg.to_toml())
    assert Config.from_toml(tmp_path / "c.toml").sources[0].chat_template_kwargs == kwargs
    tok = Tokenize(str(tokenizer_path), "<|endoftext|>")
    tokens = ChatTokens.for_source(cfg, 0, tok)
    conv = word_conversations(seed=4, n=1)[0]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_path)),
                                              eos_token="<|endoftext|>")
    want = hf.apply_chat_template(conv, tokenize=False, chat_template=effort + CHATML, **kwargs)
    assert want.startswith("<|im_start|>system\nReasoning: high /no_think<|im_end|>")
    assert tokens.template.render(conv) == want
    plain = cfg.replace(sources=[msgspec.structs.replace(source, chat_template_kwargs={})])
    assert cfg.order_digest("t") != plain.order_digest("t")
    assert len(plain.order_settings("t")["sources"][0][-1]) == 3  # unset: the settings of before
    with pytest.raises(ConfigError, match="sets tools, which the loader passes itself"):
        msgspec.structs.replace(source, chat_template_kwargs={"tools": "x"}).__post_init__()
    with pytest.raises(ConfigError, match="chat_template_kwargs .* is for chat sources"):
        SourceConfig(name="s", uri="file:///x/", chat_template_kwargs={"a": 1})
    # chat_template and loss_on on a text source were ignored: it trained on every token of `text`
    with pytest.raises(ConfigError, match=r"sources\[s\].chat_template = 'chatml.jinja': is for chat sources"):
        SourceConfig(name="s", uri="file:///x/", chat_template="chatml.jinja")
    with pytest.raises(ConfigError, match=r"sources\[s\].loss_on = 'last_assistant': is for chat sources"):
        SourceConfig(name="s", uri="file:///x/", loss_on="last_assistant")
    SourceConfig(name="s", uri="file:///x/", loss_on="assistant")  # the default, said again


def test_a_long_conversation_with_an_unmarked_template_says_its_cost_once(caplog):
    conv = [m for i in range(40) for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"})]
    caplog.set_level("WARNING", logger="zephon_stream.loader")
    plain, marked = ChatTemplate(CHATML, "chatml.jinja"), ChatTemplate(CHATML_GEN, "chatml-gen.jinja")
    for _ in range(3):
        assert plain.spans(conv, "assistant")[1] == marked.spans(conv, "assistant")[1]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("chat template chatml.jinja has no {% generation %} marks, so each "
                                                 "assistant turn is found from renders"), said
    assert "a conversation of 40 assistant turns takes 120 renders" in said[0]


def test_a_missing_template_says_what_to_set(tmp_path):
    tok = str(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"source 'sft' is a chat source .* there is no .*tokenizer_config.json\. "
                                          r"Set chat_template = "):
        load_template(None, tok, "source 'sft'")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ConfigError, match="tokenizer_config.json has no chat_template. Set chat_template"):
        load_template(None, tok, "source 'sft'")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "a", "template": "A"},
                                                                                  {"name": "b", "template": "B"}]}))
    with pytest.raises(ConfigError, match="several chat templates .a, b. and none named 'default'"):
        load_template(None, tok)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a readable JSON file"):
        load_template(None, tok)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="chat_template '/nonexistent/t.jinja' cannot be read"):
        load_template("/nonexistent/t.jinja", tok)


def test_a_template_that_does_not_compile_is_a_config_error(tmp_path):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}\n{{ m.content }\n")
    with pytest.raises(ConfigError, match=r"t.jinja does not compile \(line 2\)"):
        load_template(str(tmp_path / "t.jinja"), str(tmp_path / "tokenizer.json"))


def test_a_jinja2_with_known_sandbox_escapes_is_refused(monkeypatch):
    import jinja2

    from zephon_stream import chat

    monkeypatch.setattr(jinja2, "__version__", "3.1.5")
    chat._environment.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"jinja2 3.1.5 has known sandbox escapes.*install jinja2 >= 3.1.6"):
            ChatTemplate(CHATML)
    finally:
        chat._environment.cache_clear()
