"""Chat sources: render conversations with a chat template, and mark the tokens trained on.

A chat source's records hold a conversation, a list of `{"role", "content"}` messages (OpenAI /
Hugging Face style). Its chat template, a Jinja template as Hugging Face ships them, renders the
conversation to text, in a sandboxed environment like the one `transformers` uses (a template
is code). The text is tokenized with offsets, and a token is trained when it overlaps a trained
character span (the rule of `transformers`' assistant mask). The spans come from the
template's `{% generation %}` markers when it has them; otherwise from renders of the
conversation's prefixes, since most templates in the wild have no markers:

```
messages:  [user "What is 2+2?"] [assistant "4."]                            (ChatML template)
P1 = render(messages[:1]) = "<|im_start|>user\\nWhat is 2+2?<|im_end|>\\n"
P2 = render(messages[:2]) = P1 + "<|im_start|>assistant\\n4.<|im_end|>\\n"   (P1 must be a prefix of P2)
message 2's span:  P2[len(P1):]
probe = render(messages[:1] + [assistant "\\ue000"]) = P1 + "<|im_start|>assistant\\n" + "\\ue000" + "<|im_end|>\\n"
           head = "<|im_start|>assistant\\n"  tail = "<|im_end|>\\n"   (what the template puts around the content)
trained:   "4.<|im_end|>"  = the content, then the tail less its trailing whitespace (the end of turn)
```

So a message's content is found by rendering it once with a sentinel content (a private-use
character that appears nowhere in the conversation or the template), which also finds content
that the template trims or cuts (a reasoning part dropped: what is rendered is trained). A
template whose prefix renders are not prefixes of each other, or whose text around a message's
content depends on the content, is refused for that conversation (a `DataError`: add
`{% generation %}` markers to it). With markers, a block's output travels between two unused
private-use characters and is found in the text after the render, wherever Jinja buffered it.

A template sees `messages`, `add_generation_prompt = False`, and the special tokens: the
config's `eos_token` / `bos_token` for a template file, the `*_token` entries of the
tokenizer_config.json whose template it is (so what the order digest hashes decides the text).
`strftime_now` formats `FIXED_NOW`, not the clock, so a render is a pure function of its record.

`loss_on`: `"assistant"`, every assistant message (every generation block, with markers);
`"last_assistant"`, the last one only; `"all"`, every token of the conversation. The document
is `[BOS] + tokens + [EOS]` as for text (BOS with a `bos_token`, unless the template wrote it
first; EOS unless the template wrote it last). BOS is never trained, the EOS the loader adds is
trained under `"all"` only: under the assistant scopes the template's own end of turn, inside the
trained span, is what the model learns to stop on.

Messages: `role` is one of `ROLES` (system, user, assistant, tool); `content` a string, a list of
text parts (`[{"type": "text", "text": ...}]`, passed to the template as it is), or null
(or absent) in an assistant message that only calls tools (`tool_calls`, a list of objects); other
keys go to the template as they are. A source's `tools_field` gives each conversation its tools
(a list of function specs, or a JSON string of one), the template's `tools`; its `documents_field`
the retrieved documents (a list of objects such as `{"title": ..., "text": ...}`, or a JSON string
of one), the template's `documents`, as `apply_chat_template(documents=...)` passes them. For the sentinel
render a tool-calling message loses its calls: the sentinel stands for all that the assistant
wrote, so the calls are trained with the content. A bad conversation (no role, an unknown role,
content that is not a string, tools or documents that are not a list of objects, no messages, a template that
raises) is a `DataError` naming the shard and the record, or a counted skip under
`on_bad_record = "skip"`.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from zephon_stream.errors import ConfigError, DataError
from zephon_stream.operators.types import ChatDoc, Conversation, located

__all__ = ["FIXED_NOW", "ROLES", "ChatTemplate", "ChatTokens", "LossOn", "check_documents", "check_messages",
           "check_tools", "load_template", "token_mask"]

log = logging.getLogger("zephon_stream.loader")

ROLES = ("system", "user", "assistant", "tool")
#: Assistant turns from which an unmarked template's cost is said once: its prefix renders grow
#: with the square of the turns (a 128-turn conversation of Qwen 2.5's tool template: 256 ms
#: against 3.25 ms with {% generation %} marks; bench/chat.py)
LONG_CONVERSATION_TURNS = 32
# roles other formats use (ShareGPT, Llama 3.1's ipython, OpenAI's function and developer): named in errors
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant", "ipython": "tool",
                 "function": "tool", "observation": "tool", "developer": "system"}
LossOn = Literal["assistant", "last_assistant", "all"]
#: The instant `strftime_now` formats: a render is a pure function of the conversation (the
#: determinism contract), so not today's date; this is the Llama 3.1 template's own default date.
FIXED_NOW = datetime(2024, 7, 26, tzinfo=timezone.utc)
_PRIVATE = range(0xE000, 0xF900)  # Unicode private-use characters: sentinels and generation marks
_MARKS: ContextVar[tuple[str, str] | None] = ContextVar("zephon_generation_marks", default=None)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplate:
    """A compiled chat template: renders conversations and finds their trained character spans.

    `variables` are passed to every render (the special tokens, as `transformers` passes its
    tokenizer's `special_tokens_map`), with `add_generation_prompt = False`.
    """

    #: the model's "tool_use" template, rendered instead for a conversation offered tools (as
    #: `transformers` picks it); None: this template renders every conversation
    tool_use: ChatTemplate | None = None

    def __init__(self, source: str, origin: str = "<string>", variables: dict[str, Any] | None = None) -> None:
        self.source, self.origin, self.variables = source, origin, dict(variables or {})
        self.marked = bool(_GENERATION.search(source))
        self._warned_long = False
        self._seen = source + "".join(v for v in self.variables.values() if isinstance(v, str))  # rendered too
        self._template = _compile(source, origin)

    def __repr__(self) -> str:
        return f"ChatTemplate({self.origin}, {'generation markers' if self.marked else 'prefix renders'})"

    def render(self, messages: list[dict[str, Any]], tools: Any = None, documents: Any = None) -> str:
        """The text of `messages` offered `tools` and `documents` (all checked: `check_messages`,
        `check_tools`, `check_documents`); a DataError if the template raises."""
        check_messages(messages)
        return self._render(messages, check_tools(tools), check_documents(documents))

    def spans(self, messages: list[dict[str, Any]], loss_on: LossOn, tools: Any = None,
              documents: Any = None) -> tuple[str, list[tuple[int, int]]]:
        """The text of `messages` (offered `tools` and `documents`) and the `[start, end)`
        character spans trained under `loss_on`."""
        check_messages(messages)
        tools, documents = check_tools(tools), check_documents(documents)
        if loss_on == "all":
            text = self._render(messages, tools, documents)
            return text, [(0, len(text))]
        if self.marked:
            text, spans = self._marked(messages, tools, documents)
            return text, spans[-1:] if loss_on == "last_assistant" else spans
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        return self._by_prefixes(messages, tools, documents, turns[-1:] if loss_on == "last_assistant" else turns)

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None, documents: list[Any] | None,
                upto: int | None = None) -> str:
        part = messages if upto is None else messages[:upto]
        try:
            return self._template.render(messages=part, tools=tools, documents=documents, add_generation_prompt=False,
                                         **self.variables)
        except Exception as exc:  # a template is user code: whatever it raises is this conversation's failure
            what = "the whole conversation" if upto is None or upto == len(messages) else f"its first {upto} messages"
            raise DataError(f"chat template {self.origin} raised on {what}: {type(exc).__name__}: {exc}") from exc

    def _marked(self, messages: list[dict[str, Any]], tools: list[Any] | None,
                documents: list[Any] | None) -> tuple[str, list[tuple[int, int]]]:
        """Render with every generation block between two marks, then take the marks out."""
        begin, end = _unused([messages, tools, documents], self._seen, 2)
        with _marking(begin, end):
            raw = self._render(messages, tools, documents)
        text, spans, open_at, pos = [], [], None, 0
        for piece in re.split(f"([{begin}{end}])", raw):
            if piece == begin or piece == end:
                if (piece == begin) != (open_at is None):
                    raise self._bad_marks()
                if piece == end:
                    spans.append((open_at, pos))
                open_at = pos if piece == begin else None
                continue
            text.append(piece)
            pos += len(piece)
        if open_at is not None:
            raise self._bad_marks()
        return "".join(text), spans

    def _bad_marks(self) -> DataError:
        return DataError(f"chat template {self.origin}: its {{% generation %}} blocks nest or their output is cut "
                         "(a block inside another, or inside a string that is then cut or filtered): mark each "
                         "assistant message once, at the top level")

    def _by_prefixes(self, messages: list[dict[str, Any]], tools: list[Any] | None, documents: list[Any] | None,
                     turns: list[int]) -> tuple[str, list[tuple[int, int]]]:
        """Each turn's span from renders of the prefixes that end just before and just after it (each
        render a prefix of the next); its content from a render with a sentinel content (and no tool
        calls: the sentinel stands for all that the assistant wrote, and the template renders it as
        it renders any assistant message)."""
        if len(turns) >= LONG_CONVERSATION_TURNS and not self._warned_long:
            self._warned_long = True
            log.warning("chat template %s has no {%% generation %%} marks, so each assistant turn is found from "
                        "renders of the conversation's prefixes, which costs the square of the turns: a conversation "
                        "of %d assistant turns takes %d renders; mark the assistant's part with {%% generation %%} "
                        "... {%% endgeneration %%} to render each conversation once", self.origin, len(turns),
                        3 * len(turns))
        renders, last = {0: ""}, 0
        for k in sorted({len(messages), *turns, *(i + 1 for i in turns)} - {0}):
            renders[k] = self._render(messages, tools, documents, k)
            if not renders[k].startswith(renders[last]):
                raise DataError(self._not_prefix(last, k, renders[last], renders[k]))
            last = k
        text, spans = renders[len(messages)], []
        (sentinel,) = _unused([messages, tools, documents], self._seen, 1) if turns else ("",)
        for i in turns:
            lo, hi = len(renders[i]), len(renders[i + 1])
            plain = {k: v for k, v in messages[i].items() if k != "tool_calls"}
            probe = self._render([*messages[:i], {**plain, "content": sentinel}], tools, documents)
            head, found, tail = probe[lo:].partition(sentinel)
            if (not probe.startswith(renders[i]) or not found or sentinel in tail or hi - lo < len(head) + len(tail)
                    or not text.startswith(head, lo) or not text.endswith(tail, lo, hi)):
                raise DataError(f"chat template {self.origin} renders message {i} (assistant) in a way its content "
                                "cannot be found in (the text around the content depends on the content): add "
                                "{% generation %} ... {% endgeneration %} around what is trained on")
            spans.append((lo + len(head), hi - len(tail) + len(tail.rstrip())))
        return text, spans

    def _not_prefix(self, j: int, k: int, before: str, after: str) -> str:
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        return (f"chat template {self.origin} is not incremental: the render of the first {j} messages is not a "
                f"prefix of the render of the first {k} (they differ at character {at}: {before[at:at + 40]!r} vs "
                f"{after[at:at + 40]!r}), so the messages' spans cannot be found from prefix renders: add "
                "{% generation %} ... {% endgeneration %} around what is trained on, or use loss_on = \"all\"")


def check_messages(messages: Any) -> None:
    """Raise a DataError unless `messages` is a non-empty list of messages with a known role and
    string content."""
    if not isinstance(messages, list):
        raise DataError(f"the conversation is {_kind(messages)}, not a list of messages")
    if not messages:
        raise DataError("the conversation is empty (no messages)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"message {i} is {_kind(m)}, not an object with role and content")
        if "role" not in m:
            sharegpt = " (ShareGPT style: map from/value to role/content with a map step)" if "from" in m else ""
            raise DataError(f"message {i} has no role (keys: {', '.join(map(str, m)) or 'none'}){sharegpt}")
        if m["role"] not in ROLES:
            alias = _ROLE_ALIASES.get(m["role"]) if isinstance(m["role"], str) else None
            hint = (f" ({m['role']!r} looks like {alias!r}: rename the roles with a map step, "
                    "[[sources.transforms]])" if alias else "")
            raise DataError(f"message {i} has role {m['role']!r}; a role is one of {', '.join(ROLES)}{hint}")
        if isinstance(m.get("content"), list):
            _check_parts(i, m["role"], m["content"])
            continue
        if not isinstance(m.get("content"), str):
            calls = m.get("tool_calls")
            if m["role"] == "assistant" and m.get("content") is None and calls:
                if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                    raise DataError(f"message {i} (assistant) has tool_calls that are {_kind(calls)}, not a list "
                                    "of objects")
                continue  # a message that only calls tools: the template writes the calls
            what = "no content" if "content" not in m else f"content that is {_kind(m['content'])}"
            also = " (or null, with tool_calls)" if m["role"] == "assistant" else ""
            raise DataError(f"message {i} ({m['role']}) has {what}, not a string{also} or a list of text parts")


def _check_parts(i: int, role: str, parts: list[Any]) -> None:
    """Content as a list of parts (OpenAI style, `[{"type": "text", "text": ...}]`): passed to the
    template as it is, as `transformers` passes it. Text parts only: a chat source carries text."""
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise DataError(f"message {i} ({role}) has content part {j} that is {_kind(part)}, not an object "
                            "with a type")
        if part["type"] != "text":
            raise DataError(f"message {i} ({role}) has a {_short(part['type'])} part: a chat source carries text "
                            "parts only (images go to an image+text source)")
        if not isinstance(part.get("text"), str):
            raise DataError(f"message {i} ({role}) has text part {j} whose text is {_kind(part.get('text'))}, not "
                            "a string")


def check_tools(tools: Any) -> list[Any] | None:
    """The tools offered to a conversation: None (none), a list of objects (JSON-schema function
    specs, as `transformers`' `apply_chat_template(tools=...)` takes them), or a JSON string of
    such a list, decoded; a DataError otherwise."""
    return _objects(tools, "tools", "function specs")


def check_documents(documents: Any) -> list[Any] | None:
    """The documents given to a conversation (retrieval-augmented generation): None (none), a list
    of objects (`{"title": ..., "text": ...}`, as `transformers`' `apply_chat_template(documents=...)`
    takes them), or a JSON string of such a list, decoded; a DataError otherwise."""
    return _objects(documents, "documents", 'such as {"title": ..., "text": ...}')


def _objects(value: Any, what: str, such: str) -> list[Any] | None:
    """`value` as None or a list of objects, a JSON string of one decoded; a DataError otherwise.
    An empty list stays one, as `transformers` passes it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise DataError(f"the {what} are a string that is not JSON ({exc}): {_short(value)}") from exc
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise DataError(f"the {what} are {_kind(value)}, not a list of objects ({such})")
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {_short(value)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unused(messages: Any, elsewhere: str, n: int) -> list[str]:
    """`n` private-use characters that occur nowhere in the conversation (its tools, documents) nor in
    `elsewhere` (the template and its variables)."""
    seen = msgspec.json.encode(messages, enc_hook=repr).decode() + elsewhere
    found = list(itertools.islice((c for c in map(chr, _PRIVATE) if c not in seen), n))
    if len(found) < n:
        raise DataError("the conversation uses every Unicode private-use character (U+E000-U+F8FF), so none is "
                        "left to mark its spans with; use loss_on = \"all\" for it")
    return found


@contextmanager
def _marking(begin: str, end: str) -> Iterator[None]:
    token = _MARKS.set((begin, end))
    try:
        yield
    finally:
        _MARKS.reset(token)


def token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Which tokens overlap a span: token `[s, e)` is marked when `e > start` and `s < end` (the
    rule of `transformers`' assistant mask, which marks a token cut by a span's edge)."""
    mask = np.zeros(len(offsets), dtype=bool)
    if len(offsets):
        starts, ends = offsets[:, 0], offsets[:, 1]
        for lo, hi in spans:
            mask |= (ends > lo) & (starts < hi)
    return mask


class ChatTokens:
    """Turns a batch of conversations into `ChatDoc`s: check, render, tokenize (one batched call
    with offsets), and mark the trained tokens.

    Stateless, like `Tokenize`: a document's tokens depend only on its conversation.
    """

    def __init__(self, template: ChatTemplate, tokenizer: Any, loss_on: LossOn) -> None:
        if loss_on not in ("assistant", "last_assistant", "all"):
            raise ConfigError(f'loss_on {loss_on!r} is not one of "assistant", "last_assistant", "all"')
        self.template, self.tokenizer, self.loss_on = template, tokenizer, loss_on

    def __repr__(self) -> str:
        return f"ChatTokens({self.template!r}, loss_on={self.loss_on!r})"

    @classmethod
    def for_source(cls, config: Any, source: int, tokenizer: Any) -> ChatTokens:
        """The chat tokenizer of `config.sources[source]` (a chat source)."""
        src = config.sources[source]
        template = load_template(src.chat_template, config.tokenizer_file, f"source {src.name!r}",
                                 {"eos_token": config.eos_token, "bos_token": config.bos_token},
                                 src.chat_template_kwargs)
        return cls(template, tokenizer, src.loss_on)

    def __call__(self, docs: list[tuple[Any, Any]], bad: Any, key: str,
                 where: Callable[[int], str] | None = None) -> list[tuple[Any, ChatDoc]]:
        """`(ref, ChatDoc)` for each `(ref, conversation)` of `docs` (read from shard `key`); a bad
        conversation is raised, or skipped and counted, as `bad` says, and named at `where(offset)`
        (the reader's words for a record's place: a byte of the file, a row of a row group)."""
        rendered = []
        for ref, record in docs:
            messages, tools, documents = record if isinstance(record, Conversation) else (record, None, None)
            try:
                tools = check_tools(tools)
                template = self.template.tool_use if tools is not None and self.template.tool_use else self.template
                rendered.append((ref, *template.spans(messages, self.loss_on, tools, documents)))
            except DataError as exc:
                at = located(where, ref[2])
                err = DataError(f"bad conversation in {key!r} at {at}: {exc}", key=key, offset=ref[2])
                err.__cause__ = exc
                bad(err)
        encodings = self.tokenizer.encodings([text for _, text, _ in rendered]) if rendered else []
        return [(ref, self._doc(enc, spans)) for (ref, _, spans), enc in zip(rendered, encodings)]

    def _doc(self, enc: Any, spans: list[tuple[int, int]]) -> ChatDoc:
        ids = np.asarray(enc.ids, dtype=np.uint32)
        trained = (np.ones(len(ids), dtype=bool) if self.loss_on == "all"
                   else token_mask(_offsets(enc.offsets), spans))
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        head = [bos] if bos is not None and not (len(ids) and ids[0] == bos) else []
        tail = [] if len(ids) and ids[-1] == eos else [eos]
        trained = np.concatenate([np.zeros(len(head), bool), trained, np.full(len(tail), self.loss_on == "all")])
        if bos is not None:
            trained[0] = False  # the BOS, the loader's or the template's: never a target
        return ChatDoc(np.concatenate([np.asarray(head, np.uint32), ids, np.asarray(tail, np.uint32)]), trained)


def _offsets(offsets: list[tuple[int, int]]) -> np.ndarray:
    """An Encoding's offsets as an n x 2 array (fromiter: a third of asarray's time on a list of pairs)."""
    return np.fromiter(itertools.chain.from_iterable(offsets), np.int64, 2 * len(offsets)).reshape(-1, 2)


def load_template(chat_template: str | None, tokenizer: str, owner: str = "this chat source",
                  defaults: dict[str, str | None] | None = None,
                  kwargs: dict[str, Any] | None = None) -> ChatTemplate:
    """The chat template of a chat source: the file `chat_template`, else the model directory's
    that holds `tokenizer`, found as `transformers` finds it (`chat_template.jinja` and
    `additional_chat_templates/*.jinja`, else the `chat_template` of `tokenizer_config.json`),
    with its "tool_use" template, if any, as `tool_use`.

    Its variables come from where the template does, so that the bytes in the order digest
    (`Config.order_settings`: the template file, or that tokenizer_config.json) decide the
    renders: `defaults` (the config's `eos_token`, `bos_token`) with a template file; the special
    tokens (`*_token`) of the tokenizer_config.json with its template (what `transformers`
    passes), `defaults` for those it does not set. A missing or unreadable template is a
    ConfigError that says what to set. `kwargs` (a source's `chat_template_kwargs`, such as
    `enable_thinking`) go to every render last, as `apply_chat_template(**kwargs)` passes them.
    """
    variables = {k: v for k, v in (defaults or {}).items() if v is not None}
    kwargs = dict(kwargs or {})
    if chat_template is not None:
        try:
            return ChatTemplate(Path(chat_template).read_text(encoding="utf-8"), chat_template,
                                {**variables, **kwargs})
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{owner}: chat_template {chat_template!r} cannot be read ({exc}): set chat_template "
                              "to the path of a Jinja chat template file") from exc
    config_path = Path(tokenizer).parent / "tokenizer_config.json"
    tok_config = _read_tokenizer_config(config_path) if config_path.is_file() else {}
    variables = {**variables, **_special_tokens(tok_config), **kwargs}
    files = model_template_files(tokenizer)
    if files:  # chat_template.jinja and additional_chat_templates/*.jinja take priority, as in transformers
        named: Any = {("default" if p.name == CHAT_TEMPLATE_FILE else p.stem): p for p in files}
        sources = {name: _read_template_file(p, owner) for name, p in named.items()}
        value: Any = sources["default"] if list(sources) == ["default"] else [
            {"name": n, "template": t} for n, t in sources.items()]
        origin = {n: f"{named[n]}" for n in sources}
    else:
        value, origin = tok_config.get("chat_template"), {}
        if isinstance(value, list):
            origin = {t.get("name"): f"{config_path} (chat_template {t.get('name')!r})" for t in value
                      if isinstance(t, dict)}
    source = _named_template(value, config_path, owner)
    template = ChatTemplate(source, origin.get("default", f"{config_path} (chat_template)"), variables)
    tool_use = _tool_use(value)
    if tool_use is not None:
        template.tool_use = ChatTemplate(tool_use, origin.get("tool_use", "tool_use"), variables)
    return template


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # beside tokenizer_config.json, as transformers saves templates now
_CHAT_TEMPLATE_DIR = "additional_chat_templates"  # and named ones, {name}.jinja


def model_template_files(tokenizer: str) -> list[Path]:
    """The template files of the model directory that holds `tokenizer`: `chat_template.jinja` and
    `additional_chat_templates/*.jinja`, which `transformers` prefers to tokenizer_config.json's."""
    root = Path(tokenizer).parent
    files = [root / CHAT_TEMPLATE_FILE] if (root / CHAT_TEMPLATE_FILE).is_file() else []
    extra = root / _CHAT_TEMPLATE_DIR
    return files + (sorted(extra.glob("*.jinja")) if extra.is_dir() else [])


def _read_template_file(path: Path, owner: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{owner}: the model's chat template {str(path)!r} cannot be read ({exc})") from exc


def _tool_use(value: Any) -> str | None:
    """The template named "tool_use" among named templates (`transformers` renders a conversation
    given tools with it), else None."""
    if not isinstance(value, list):
        return None
    found = [t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "tool_use"]
    return found[0] if found and isinstance(found[0], str) else None


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable JSON file ({exc}): fix it, or set chat_template in the "
                          "source to a template file") from exc
    if not isinstance(found, dict):
        raise ConfigError(f"{path} holds a JSON {type(found).__name__}, not an object: fix it, or remove it")
    return found


def _special_tokens(tok_config: dict[str, Any]) -> dict[str, str]:
    """The `*_token` entries of a tokenizer_config.json, as strings (an AddedToken entry by its content)."""
    out = {}
    for name, value in tok_config.items():
        value = value.get("content") if isinstance(value, dict) else value
        if name.endswith("_token") and isinstance(value, str):
            out[name] = value
    return out


def _named_template(value: Any, path: Path, owner: str) -> str:
    """A tokenizer_config.json's `chat_template`: a string, or a list of `{name, template}` of which
    the one named "default" (or the only one) is taken, as `transformers` does."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values())) if len(named) == 1 else None)
        if not isinstance(value, str):
            raise ConfigError(f"{owner}: {path} has several chat templates ({', '.join(map(str, named))}) and none "
                              "named 'default': save the one to use in a file and set chat_template to its path")
    if not isinstance(value, str):
        where = f"{path} has no chat_template" if path.is_file() else f"there is no {path}"
        raise ConfigError(f"{owner} is a chat source (messages_field) without a chat template: {where}. Set "
                          "chat_template = \"/path/to/template.jinja\" in its [[sources]] table (a model's "
                          "chat_template.jinja, or the chat_template string of its tokenizer_config.json saved "
                          "to a file), or put the model's tokenizer_config.json next to the tokenizer")
    return value


def _compile(source: str, origin: str) -> Any:
    try:
        return _environment().from_string(source)
    except Exception as exc:  # jinja2's TemplateSyntaxError, with the line
        line = getattr(exc, "lineno", None)
        raise ConfigError(f"chat template {origin} does not compile{f' (line {line})' if line else ''}: {exc}; "
                          "fix the template") from exc


@lru_cache(maxsize=1)
def _environment() -> Any:
    """The sandboxed Jinja environment of `transformers`' chat templates (trim_blocks, lstrip_blocks,
    loopcontrols, `raise_exception`, `tojson`, `strftime_now`, a safe `dict` and `namespace`),
    with this module's `{% generation %}` extension."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ConfigError("chat sources render their template with jinja2: install zephon-stream[chat]") from exc
    if tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise ConfigError(f"jinja2 {jinja2.__version__} has known sandbox escapes, and a chat template is code: "
                          "install jinja2 >= 3.1.6")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(jinja2), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception(jinja2), strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_namespace(jinja2))
    return env


def _generation_extension(jinja2: Any) -> type:
    """`{% generation %}...{% endgeneration %}`: renders its body, between the two marks of
    `_MARKS` while a marked render is running (HF's AssistantTracker records indices instead,
    which are wrong where output is buffered, as in a macro; marks travel with the text)."""

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            marks = _MARKS.get()
            return text if marks is None else marks[0] + text + marks[1]

    return Generation


def _raise_exception(jinja2: Any) -> Any:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    return raise_exception


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """`transformers`' tojson: no HTML escaping, and its options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """`FIXED_NOW` formatted (not the clock: a render is a pure function of its conversation)."""
    return FIXED_NOW.strftime(format)


class _TemplateDict:
    """`dict` for templates, without the attributes of the type itself (as `transformers` has it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _namespace(jinja2: Any) -> type:
    """jinja2's Namespace that refuses underscore-prefixed names (CPython internals), as `transformers`'."""

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature trick: `self` may be a key
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes "
                                                      f"on a namespace ({name!r})")

    return TemplateNamespace
