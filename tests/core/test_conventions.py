"""Conventions a new user must not get wrong: label shifting, BOS, paths relative to the config,
and errors that name what to do (issue 14)."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F

from zephon_stream import ConfigError
from zephon_stream.loader.config import Config
from zephon_stream.loader.loader import Loader
from zephon_stream.operators.types import IGNORE


def _first(config: Config) -> dict:
    return next(iter(Loader(config, backend="inline")))


def test_unshifted_labels_are_the_shifted_ones_moved_one_right(config):
    shifted, unshifted = _first(config), _first(config.replace(labels="unshifted"))
    assert shifted["input_ids"].equal(unshifted["input_ids"])
    assert unshifted["labels"][:, 0].eq(IGNORE).all()
    assert unshifted["labels"][:, 1:].equal(shifted["labels"][:, :-1])
    trained = unshifted["labels"] != IGNORE  # unshifted: a trained label is the token at its own position
    assert unshifted["labels"][trained].equal(unshifted["input_ids"][trained])


def test_a_hugging_face_loss_on_unshifted_labels_equals_cross_entropy_on_shifted_ones(config):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_layer=1, n_embd=32, n_head=2, n_positions=64)).eval()
    shifted, unshifted = _first(config), _first(config.replace(labels="unshifted"))
    with torch.no_grad():
        hf = model(input_ids=unshifted["input_ids"], labels=unshifted["labels"]).loss
        logits = model(input_ids=shifted["input_ids"]).logits
    # HF drops the last position (it has no next token in the row); the shifted labels have one
    ours = F.cross_entropy(logits[:, :-1].flatten(0, 1), shifted["labels"][:, :-1].flatten(), ignore_index=IGNORE)
    assert torch.allclose(hf, ours, atol=1e-6)
    with torch.no_grad():  # the silent mistake the setting exists for: shifted labels into a model that shifts
        wrong = model(input_ids=shifted["input_ids"], labels=shifted["labels"]).loss
    assert not torch.allclose(wrong, ours, atol=1e-3)


def test_bos_token_opens_every_document(config, tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(config.tokenizer)
    tok.add_special_tokens(["<|bos|>"])
    path = tmp_path / "tok.json"
    tok.save(str(path))
    bos = tok.token_to_id("<|bos|>")
    plain = _first(config.replace(tokenizer=str(path)))
    batch = _first(config.replace(tokenizer=str(path), bos_token="<|bos|>"))
    ids, positions = batch["input_ids"], batch["position_ids"]
    starts = positions == 0  # where a document (or a piece of one) opens
    starts[:, 0] = False  # a row may open inside a document
    assert ids[starts].eq(bos).all() and int(ids.eq(bos).sum()) == int(starts.sum()) + int(ids[:, 0].eq(bos).sum())
    assert not plain["input_ids"].eq(bos).any()
    assert config.replace(bos_token="<|bos|>").order_digest("t") != config.order_digest("t")


def test_unknown_bos_and_eos_list_the_special_tokens(config):
    with pytest.raises(ConfigError, match=r"bos_token '<s>' is not in the vocabulary .*<\|endoftext\|>"):
        _first(config.replace(bos_token="<s>"))
    with pytest.raises(ConfigError, match=r"eos_token '</s>' is not in the vocabulary .*tokens: <\|endoftext\|>"):
        _first(config.replace(eos_token="</s>"))


def test_hub_style_tokenizer_name_says_to_pass_a_file(config, tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer 'gpt2' is not a file; pass the path of a tokenizer.json"):
        _first(config.replace(tokenizer="gpt2"))
    # from a config file, the name is a path relative to it: "cannot be read: [Errno 2] ..." said nothing of the hub
    tokenizer = config.tokenizer
    for name in ("gpt2", "Qwen/Qwen2-0.5B"):
        (tmp_path / "stream.toml").write_text(config.replace(tokenizer=name).to_toml())
        with pytest.raises(ConfigError, match=rf"tokenizer '{tmp_path}/{name}' is not a file or a model's directory; "
                                              r"pass the path of a tokenizer.json \(in a config file, relative to it; "
                                              r"models on a hub are not downloaded\)"):
            _first(Config.from_toml(tmp_path / "stream.toml"))
    (tmp_path / "stream.toml").write_text(config.replace(tokenizer=f"file://{tokenizer}").to_toml())
    assert Config.from_toml(tmp_path / "stream.toml").tokenizer == tokenizer  # a file:// URI, as sources take


def test_plain_and_relative_paths_in_toml_are_relative_to_the_config(config, dataset, tmp_path):
    root, _ = dataset
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "data").symlink_to(root)
    text = config.to_toml()
    text = text.replace(f'"{config.tokenizer}"', '"data/tokenizer.json"')
    text = text.replace(f'"file://{root}/a/"', '"data/a"').replace(f'"file://{root}/b/"', '"./data/b/"')
    assert '"data/a"' in text and '"./data/b/"' in text
    (tmp_path / "cfg" / "c.toml").write_text(text)
    loaded = Config.from_toml(tmp_path / "cfg" / "c.toml")
    assert loaded.tokenizer == str(tmp_path / "cfg" / "data" / "tokenizer.json")
    assert loaded.sources[0].uri == f"file://{root.resolve()}/a/"
    assert _first(loaded)["input_ids"].equal(_first(config)["input_ids"])


def test_plain_source_paths_in_a_python_config_are_from_the_working_directory(config, dataset, monkeypatch):
    # the reference says a uri may be a plain path; from Python it was refused at the first batch
    # ("unsupported URI scheme"), after the Loader had been made
    root, _ = dataset
    monkeypatch.chdir(root)
    plain = [msgspec.structs.replace(config.sources[0], uri=str(root / "a")),
             msgspec.structs.replace(config.sources[1], uri="b/")]
    loader = Loader(config.replace(sources=plain))
    assert [s.uri for s in loader.config.sources] == [f"file://{root.resolve()}/a/", f"file://{root.resolve()}/b/"]
    assert _first(config.replace(sources=plain))["input_ids"].equal(_first(config)["input_ids"])
