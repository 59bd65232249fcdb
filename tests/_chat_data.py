"""Chat test data: public chat template formats, a BPE tokenizer with their special tokens, and
conversations.

Real conversations come from the Python 3.11 FAQ (Debian's `python3.11-doc`, fetched into the
cache by `tools.corpus`): each FAQ question (a section heading) is a user message and its
section's text the assistant's answer, the FAQ's title the system message. Nothing is invented.
Small generated conversations are built from the test corpus words (`tests.core.conftest.WORDS`).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.core.conftest import make_docs

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>"]

# The templates below are the public formats, written out; each `*_GEN` is the same format with
# `{% generation %}` markers around what an assistant mask marks (the content and the end of turn).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_GEN = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}"
              "{% generation %}{{message['content'] + '<|im_end|>'}}{% endgeneration %}{{'\n'}}{% else %}"
              "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama 3 (Meta-Llama-3-8B-Instruct): BOS written by the template, content trimmed
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}"
          "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_GEN = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
              "'<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
              "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
              "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}")

# Llama 2 chat: the system prompt folded into the first user turn, roles that must alternate
# (raise_exception), BOS before each user turn and EOS after each assistant turn
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
          "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
          "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
          "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
LLAMA2_GEN = LLAMA2.replace("{{ ' '  + content.strip() + ' ' + eos_token }}",
                            "{{ ' ' }}{% generation %}{{ content.strip() + ' ' + eos_token }}{% endgeneration %}")

# Qwen 2.5 style: a default system prompt when the conversation has none
QWEN = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
        "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
        "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role == 'user' or "
        "(message.role == 'system' and not loop.first) or message.role == 'tool' %}{{- '<|im_start|>' + message.role + "
        "'\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + "
        "message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}")
QWEN_GEN = QWEN.replace("{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
                        "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- message.content + "
                        "'<|im_end|>' }}{% endgeneration %}{{- '\\n' }}")

# Qwen 2.5 with tools: the tools' specs in the system prompt, each tool call as a <tool_call> block
# after the (optional) content, tool results as user turns of <tool_response> blocks
QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}{%- for tool in tools %}"
    "{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}{{- '\\n<tool_call>\\n{\"name\": \"' }}"
    "{{- tool_call.name }}{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# the same text, with the assistant's content, calls and end of turn marked (after the role's newline)
QWEN_TOOLS_GEN = (
    QWEN_TOOLS
    .replace("{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif",
             "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
             "{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- else %}"
             "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
             "{%- elif", 1)
    .replace("{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
             "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{%- if message.content %}"
             "{{- message.content + '\\n' }}{%- endif %}", 1)
    .replace("{{- '\\n<tool_call>\\n{\"name\": \"' }}",
             "{%- if not loop.first %}{{- '\\n' }}{%- endif %}{{- '<tool_call>\\n{\"name\": \"' }}", 1)
    .replace("{%- endfor %}{{- '<|im_end|>\\n' }}{%- elif message.role == 'tool' %}",
             "{%- endfor %}{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- elif message.role == 'tool' %}", 1))

# ChatML whose content may be a string or a list of parts, OpenAI style (as multimodal-ready
# templates write it: the text parts, in order)
CHATML_PARTS = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
                "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
                "{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}")
CHATML_PARTS_GEN = CHATML_PARTS.replace(
    "{{'<|im_start|>' + message['role'] + '\\n'}}{% if message['content'] is string %}",
    "{{'<|im_start|>' + message['role'] + '\\n'}}{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{{'<|im_end|>'}}{% endgeneration %}"
    "{{'\\n'}}{% elif message['content'] is string %}").replace(
    "{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}",
    "{% endfor %}{% endif %}{% if message['role'] != 'assistant' %}{{'<|im_end|>\\n'}}{% endif %}{% endfor %}")

# name: (plain template, marked template, eos_token, bos_token)
TEMPLATES: dict[str, tuple[str, str, str, str | None]] = {
    "chatml": (CHATML, CHATML_GEN, "<|endoftext|>", None),
    "llama3": (LLAMA3, LLAMA3_GEN, "<|endoftext|>", "<|begin_of_text|>"),
    "llama2": (LLAMA2, LLAMA2_GEN, "</s>", "<s>"),
    "qwen": (QWEN, QWEN_GEN, "<|endoftext|>", None),
}


def train_tokenizer(path: Path, texts: list[str]) -> Path:
    """A byte-level BPE with the templates' special tokens, trained on `texts`, saved at `path`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return path


def word_conversations(seed: int, n: int, turns: int = 3) -> list[list[dict[str, Any]]]:
    """Generated conversations of the test corpus words: an optional system message, then
    user/assistant turns (contents with edge spaces and newlines, some empty)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = [{"role": "system", "content": make_docs(rng, 1, 8)[0]}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, turns)):
            for role in ("user", "assistant"):
                text = make_docs(rng, 1, 30)[0]
                conv.append({"role": role, "content": rng.choice(["", " ", "\n"]) + text if rng.random() < 0.3
                             else text})
        out.append(conv)
    return out



def tool_conversations(seed: int, n: int) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """Generated (conversation, tools) pairs of tool use, in the forms datasets hold it: the tools
    as function specs (or none); assistant messages that call tools with null content, with no
    content key, or with content too, one or several calls (`function` wrapped or not, arguments
    an object or a JSON string); one or more tool results in a row; then an answer."""
    rng = random.Random(seed)
    words = lambda k: make_docs(rng, 1, k)[0]  # noqa: E731
    out = []
    for _ in range(n):
        names = [f"{words(1)}_{i}" for i in range(rng.randint(1, 3))]
        tools = [{"type": "function", "function": {"name": name, "description": words(8), "parameters": {
            "type": "object", "properties": {"query": {"type": "string", "description": words(4)}},
            "required": ["query"]}}} for name in names] if rng.random() < 0.8 else None
        conv = [{"role": "system", "content": words(6)}] if rng.random() < 0.4 else []
        for _ in range(rng.randint(1, 2)):
            conv.append({"role": "user", "content": words(20)})
            calls = []
            for _ in range(rng.randint(1, 3)):
                args = {"query": words(3)} if rng.random() < 0.7 else json.dumps({"query": words(3)})
                call = {"name": rng.choice(names), "arguments": args}
                calls.append({"type": "function", "function": call} if rng.random() < 0.7 else call)
            form = rng.choice(["null", "absent", "text"])
            message = {"role": "assistant", "tool_calls": calls}
            if form != "absent":
                message["content"] = words(10) if form == "text" else None
            conv.append(message)
            conv += [{"role": "tool", "content": words(15)} for _ in calls]
            conv.append({"role": "assistant", "content": words(25)})
        out.append((conv, tools))
    return out


def write_word_chats(root: Path, n: int, shards: int) -> Path:
    """`root/sft/part-*.jsonl`: `n` word conversations (seed 13, up to 3 turns) in `shards`
    shards of a `messages` field; `root/tokenizer.json` with ChatML's tokens; `root/chatml.jinja`."""
    (root / "sft").mkdir()
    conversations = word_conversations(seed=13, n=n, turns=3)
    per = n // shards
    for s in range(shards):
        part = conversations[s * per:(s + 1) * per]
        (root / "sft" / f"part-{s}.jsonl").write_bytes(b"".join(
            msgspec.json.encode({"id": i, "messages": c}) + b"\n" for i, c in enumerate(part)))
    train_tokenizer(root / "tokenizer.json", make_docs(random.Random(3), 300, 40))
    (root / "chatml.jinja").write_text(CHATML)
    return root

def write_jsonl_beside(folder: Path, pairs: list[tuple[list[dict[str, Any]], Any]], field: str,
                       rng: random.Random) -> None:
    """Conversations with a value beside them (tools, documents) as 3 JSONL shards in `folder`:
    the value as it is, a JSON string of it, null, or the key absent (`rng` picks)."""
    folder.mkdir()
    lines = []
    for i, (conv, value) in enumerate(pairs):
        record: dict[str, Any] = {"id": i, "messages": conv}
        if value is not None or rng.random() < 0.5:  # none: the key absent, or null
            record[field] = json.dumps(value) if value is not None and rng.random() < 0.4 else value
        lines.append(msgspec.json.encode(record) + b"\n")
    for s in range(3):
        (folder / f"part-{s}.jsonl").write_bytes(b"".join(lines[s::3]))


def write_parquet_beside(root: Path, pairs: list[tuple[list[dict[str, Any]], Any]], field: str,
                         row_group_size: int) -> None:
    """The same as 3 Parquet shards each in `root/pq-list/` (the value as nested columns) and
    `root/pq-str/` (as a JSON string); null where there is none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, as_string in (("pq-str", True), ("pq-list", False)):
        (root / name).mkdir()
        for s in range(3):
            part = pairs[s::3]
            values = [json.dumps(v) if as_string and v is not None else v for _, v in part]
            pq.write_table(pa.table({"messages": [c for c, _ in part], field: values}),
                           root / name / f"part-{s}.parquet", row_group_size=row_group_size)


_HEADING = re.compile(r"^(?P<title>\S.*)\n(?P<line>([=\-~^\"'`#*+])\3{2,})\n", re.MULTILINE)


def faq_conversations(max_turns: int = 3) -> list[list[dict[str, Any]]]:
    """Conversations from the Python 3.11 FAQ (questions and their answers, in order), or skip."""
    from tools.corpus import ensure_debian_docs

    root = ensure_debian_docs()
    faq = root / "usr/share/doc/python3.11/html/_sources/faq" if root else None
    if faq is None or not faq.is_dir():
        pytest.skip("the Python 3.11 FAQ (Debian python3.11-doc) is not in the cache and cannot be fetched "
                    "(apt-get download unavailable)")
    out = []
    for path in sorted(faq.glob("*.rst.txt")):
        title, pairs = _questions(path.read_text(encoding="utf-8"))
        for i in range(0, len(pairs), max_turns):
            conv = [{"role": "system", "content": title}]
            for question, answer in pairs[i:i + max_turns]:
                conv += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            out.append(conv)
    assert out, f"no questions found under {faq}"
    return out


def _questions(text: str) -> tuple[str, list[tuple[str, str]]]:
    """An FAQ file's title and its (question heading, answer text) sections, in order."""
    heads = [m for m in _HEADING.finditer(text) if len(m["line"]) >= len(m["title"].rstrip())]
    pairs = []
    for m, nxt in zip(heads, heads[1:] + [None]):
        body = text[m.end():nxt.start() if nxt else len(text)].strip()
        if m["title"].rstrip().endswith("?") and body:
            pairs.append((m["title"].strip(), body))
    title = next((m["title"].strip() for m in heads if not m["title"].strip().endswith("?")), "Python FAQ")
    return title, pairs
