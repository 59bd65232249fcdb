"""Transforms and filters for the tests, importable by name in every process (tests/core/test_transforms.py).

Each is a pure function of the record, as the contract asks; the seeded ones draw only from `seed`.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

__all__ = ["NOT_CALLABLE", "at_least_words", "drop_bang", "drop_bang_numpy", "is_async", "keep_some", "nested_lang_en",
           "raises", "raises_on_boom", "returns_list", "returns_none", "returns_str", "seeded_word", "shout",
           "to_messages"]

NOT_CALLABLE = 3


def drop_bang(record: dict[str, Any]) -> bool:
    """Keep the documents that do not end with "!" (a third of the test data does)."""
    return not record["text"].endswith("!")


def drop_bang_numpy(record: dict[str, Any]) -> np.bool_:
    """drop_bang, answered with a NumPy bool (what a comparison of arrays gives)."""
    return np.bool_(not record["text"].endswith("!"))


def at_least_words(record: dict[str, Any]) -> bool:
    """Keep documents of 8 words or more."""
    return len(record["text"].split()) >= 8


def shout(record: dict[str, Any]) -> dict[str, Any]:
    """The text in capitals, with a marker in front."""
    return {**record, "text": "LOUD " + record["text"].upper()}


def seeded_word(record: dict[str, Any], seed: int) -> dict[str, Any]:
    """Append a word chosen by the per-record seed (the only randomness a transform may use)."""
    word = random.Random(seed).choice(["alpha", "beta", "gamma", "delta"])
    record["text"] = record["text"] + " " + word
    return record


def keep_some(record: dict[str, Any], *, seed: int) -> bool:
    """Keep about two thirds of the records, chosen by the per-record seed."""
    return seed % 3 != 0


def nested_lang_en(record: dict[str, Any]) -> bool:
    """Keep records whose struct `doc` says lang = "en" (a record without `doc` is dropped)."""
    return record.get("doc", {}).get("lang") == "en"


def to_messages(record: dict[str, Any]) -> dict[str, Any]:
    """A text record as a one-turn conversation, in `messages`."""
    return {"messages": [{"role": "user", "content": "say it"}, {"role": "assistant", "content": record["text"]}]}


def returns_none(record: dict[str, Any]) -> None:
    """A map that forgot its return."""
    record["text"] = record["text"].strip()


def returns_list(record: dict[str, Any]) -> list[str]:
    return [record["text"]]


def returns_str(record: dict[str, Any]) -> str:
    """A filter that returns the text instead of a bool."""
    return record["text"]


async def is_async(record: dict[str, Any]) -> bool:
    return True


def raises(record: dict[str, Any]) -> dict[str, Any]:
    if record["text"].endswith("?\n"):
        raise KeyError("no such thing")
    return record


def raises_on_boom(record: dict[str, Any]) -> dict[str, Any]:
    if "BOOM" in record["text"]:
        raise ValueError("a record the function cannot take")
    return record
