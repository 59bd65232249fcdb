"""The public surface: every public module declares `__all__`, and it holds what it says.

A module is public unless a part of its dotted name starts with `_`. The top-level names are
listed here in full, so adding or removing one is a deliberate change (httpx's
`test_exported_members`). The README and the examples import only public names.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import zephon_stream

ROOT = Path(zephon_stream.__file__).parent
REPO = ROOT.parent

TOP_LEVEL = {
    "AccessDenied", "AlreadyExists", "BaseVersionMismatch", "BatchStream", "BucketNotFound", "CheckpointError",
    "Config", "ConfigError", "ConnectorError", "DataError", "DecodeWorkerError", "DigestMismatch", "IncompatibleState",
    "LaneState",
    "Loader", "LoaderState", "LoaderStatistics", "ObjectNotFound", "Publisher", "RefitError", "ScheduleEntry",
    "Sharding", "SourceConfig", "StateHeader", "Subscriber", "Throttled", "VersionConflict", "VisionConfig",
    "ZephonError", "state_from_bytes", "state_to_bytes", "Map", "Filter", "TransformStep",
}


def _public_modules() -> list[str]:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("zephon_stream", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] in ("__init__", "__main__"):
            parts = parts[:-1] if parts[-1] == "__init__" else ()
        if parts and not any(p.startswith("_") for p in parts):
            names.append(".".join(parts))
    return names


@pytest.mark.parametrize("name", _public_modules())
def test_every_public_module_declares_what_it_exports(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ names something twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names {missing}, which it does not have"


def test_the_top_level_names() -> None:
    assert set(zephon_stream.__all__) == TOP_LEVEL
    for name in TOP_LEVEL:
        assert getattr(zephon_stream, name) is not None


def _imports(source: str) -> list[tuple[str, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zephon_stream"):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.startswith("zephon_stream")]
    return out


def _readme_imports() -> list[tuple[str, str]]:
    """The imports in the README's python blocks (fragments, so by line, not parsed whole)."""
    blocks = "\n".join(re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S))
    out = []
    for line in blocks.splitlines():
        if m := re.match(r"\s*from (zephon_stream[\w.]*) import (.+)", line):
            out += [(m[1], n.strip().split(" as ")[0]) for n in m[2].split("#")[0].strip("() ").split(",") if n.strip()]
        elif m := re.match(r"\s*import (zephon_stream[\w.]*)", line):
            out.append((m[1], ""))
    return out


@pytest.mark.parametrize("where", ["README.md", *sorted(p.name for p in (REPO / "examples").glob("*.py"))])
def test_readme_and_examples_use_only_public_names(where: str) -> None:
    found = _readme_imports() if where == "README.md" else _imports((REPO / "examples" / where).read_text())
    assert where != "README.md" or found, "the README shows no import"
    public = set(_public_modules())
    for module, name in found:
        assert module in public, f"{where} imports the private module {module}"
        if name:
            exported = importlib.import_module(module).__all__
            assert name in exported, f"{where} imports {name} from {module}, which does not export it"
