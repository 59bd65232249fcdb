"""The README's config reference is generated from `Config` and never drifts from it."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from zephon_stream.loader.config import Config, ScheduleEntry, SourceConfig, VisionConfig
from zephon_stream.loader.reference import EXECUTION, config_reference, undocumented

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_config_key_has_a_meaning():
    assert undocumented() == [], "document these keys in zephon_stream/loader/reference.py MEANINGS"


def test_readme_holds_the_generated_reference():
    text = README.read_text()
    m = re.search(r"<!-- config-reference:start -->\n(.*?)<!-- config-reference:end -->", text, re.S)
    assert m, "README.md has no config reference section"
    assert m.group(1) == config_reference(), (
        "README.md's config reference is stale: paste `python -m zephon_stream.loader.reference` between the markers")


def test_kinds_agree_with_the_order_settings():
    cfg = Config(seed=1, lanes=2, seq_len=600, global_batch_size=2, tokenizer="t", bos_token="<s>", labels="unshifted",
                 shuffle_scope="source",
                 vision=VisionConfig(), schedule=[ScheduleEntry(step=5, weights={"a": 1.0})],
                 sources=[SourceConfig(name="a", uri="file:///x/", image_field="png")])
    text = cfg.replace(vision=None, packing="none", truncate=True, piece_tokens=512,
                       sources=[SourceConfig(name="a", uri="file:///x/")])
    order = set(cfg.order_settings("sha")) | set(text.order_settings("sha"))
    for f in msgspec.structs.fields(Config):
        in_order = f.name in order or {"tokenizer": "tokenizer_sha256"}.get(f.name) in order
        assert in_order == (("", f.name) not in EXECUTION), f.name
