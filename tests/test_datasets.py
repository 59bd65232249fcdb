"""The demo corpus tool (tools/corpus.py) and the public shard writer, offline."""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import msgspec
import pytest
import zstandard
from tokenizers import Tokenizer

from tools import corpus as ds
from zephon_stream.formats import write_jsonl_shards


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, str]]:
    return ds.collect_documents(400_000, debian_docs=False)


def _read_lines(path: Path) -> list[bytes]:
    raw = path.read_bytes()
    if path.name.endswith(".zst"):
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True).read()
    assert raw == b"" or raw.endswith(b"\n")
    return raw.splitlines(keepends=True)


def _frames(path: Path) -> list[tuple[bytes, int]]:
    """Decode a zstd file one frame at a time: [(frame's content, content size from its header)]."""
    data = path.read_bytes()
    out = []
    while data:
        if int.from_bytes(data[:4], "little") == 0x184D2A5E:  # the seek table: a skippable frame, last
            n = int.from_bytes(data[-9:-5], "little")
            assert n == len(out) and len(data) == 8 + 8 * n + 9, "seek table lists every frame"
            break
        size = zstandard.frame_content_size(data)
        dobj = zstandard.ZstdDecompressor().decompressobj()
        content = dobj.decompress(data)
        assert dobj.eof, "truncated frame"
        out.append((content, size))
        data = dobj.unused_data
    return out


# ------------------------------------------------------------------------------------------ sources


def test_collect_documents_is_real_deterministic_text(docs: list[tuple[str, str]]) -> None:
    total = sum(len(t.encode("utf-8")) for _, t in docs)
    assert total >= 400_000
    ids = [i for i, _ in docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(i.startswith("stdlib/") for i in ids)
    assert all(t.strip() and "\x00" not in t for _, t in docs)
    assert all(len(t.encode("utf-8")) <= ds.MAX_DOC_BYTES for _, t in docs)
    joined = " ".join(t for _, t in docs)
    assert all(word in joined for word in (" the ", " return ", " of ", "import "))
    # Each document is a real file of the standard library (or a section of one).
    root = Path(sysconfig.get_paths()["stdlib"])
    doc_id, text = next((i, t) for i, t in docs if "#" not in i)
    assert (root / doc_id.removeprefix("stdlib/")).read_text(encoding="utf-8") == text
    # Same call, same list; a smaller budget gives a subset.
    assert ds.collect_documents(400_000, debian_docs=False) == docs
    small = ds.collect_documents(100_000, debian_docs=False)
    assert set(small) < set(docs)


def test_big_files_are_cut_at_paragraphs() -> None:
    paragraphs = [f"Paragraph {i}: " + "word " * (50 + i % 300) for i in range(400)]
    text = "\n\n".join(paragraphs) + "\n"
    parts = ds._sections("big.txt", text, max_bytes=8192)
    assert len(parts) > 10
    assert [i for i, _ in parts] == [f"big.txt#{k:04d}" for k in range(len(parts))]
    assert "".join(p for _, p in parts) == text
    assert all(len(p.encode()) <= 8192 for _, p in parts)
    assert all(p.startswith("Paragraph ") for _, p in parts)
    # One over-long line with multi-byte characters: cut on character boundaries.
    line = "é" * 10_000
    pieces = ds._cut(line, 999, ("\n\n", "\n"))
    assert "".join(pieces) == line and all(len(p.encode()) <= 999 for p in pieces)
    assert ds._sections("small.txt", "hello\n") == [("small.txt", "hello\n")]


def test_html_to_text_drops_markup_scripts_and_styles() -> None:
    page = (
        "<html><head><title>T</title><style>p {color: red}</style></head><body>"
        "<h1>Memory&nbsp;management</h1><script>var x = 1;</script>"
        "<p>The <em>slab</em>\n   allocator &amp; friends.</p><pre>  int x;\n  x = 1;</pre>"
        "<ul><li>one</li><li>two</li></ul></body></html>"
    )
    text = ds.html_to_text(page)
    assert "color" not in text and "var x" not in text and "<" not in text and "T\n" not in text
    assert "Memory\xa0management" in text
    assert "The slab allocator & friends." in text
    assert "  int x;\n  x = 1;" in text
    assert "one" in text and "two" in text and text.endswith("\n")


def test_debian_tree_keeps_sources_not_renderings_and_drops_duplicates(tmp_path: Path) -> None:
    doc = tmp_path / "usr/share/doc"
    files = {
        "linux-doc-6.1/Documentation/PCI/pci.rst.gz": b"PCI\n===\n\nHow to write PCI drivers.\n",
        "linux-doc-6.1/Documentation/ABI/testing/sysfs-bus-pci.gz": b"What: /sys/bus/pci\n",
        "linux-doc-6.1/Documentation/devicetree/x.yaml.gz": b"title: x\n",
        "linux-doc-6.1/Documentation/Makefile.gz": b"all:\n",
        "linux-doc-6.1/html/_sources/PCI/pci.rst.txt": b"PCI\n===\n\nHow to write PCI drivers.\n",
        "linux-doc-6.1/html/PCI/pci.html": b"<p>How to write PCI drivers.</p>",
        "linux-doc-6.1/html/_static/basic.css": b"body {}",
        "python3.11/html/_sources/tutorial/index.rst.txt": b"The Python Tutorial\n",
        "python3.11/html/tutorial/index.html": b"<p>The Python Tutorial</p>",
        "python3.11/html/genindex-A.html": b"<p>index</p>",
        "other/page.html": b"<p>Only rendered here.</p>",
        "other/binary.txt": b"\x00\x01\x02",
        "other/latin1.txt": "café".encode("latin-1"),
    }
    for rel, content in files.items():
        path = doc / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(content, mtime=0) if rel.endswith(".gz") else content)
    ds._prune_to_unique_docs(tmp_path)
    kept = sorted(p.relative_to(doc).as_posix() for p in doc.rglob("*") if p.is_file())
    assert kept == [
        "linux-doc-6.1/Documentation/ABI/testing/sysfs-bus-pci.gz",
        "linux-doc-6.1/Documentation/PCI/pci.rst.gz",
        "other/page.html",
        "python3.11/html/_sources/tutorial/index.rst.txt",
    ]
    (tmp_path / ds._DEBIAN_MARKER).write_text("test\n")
    rels = [r.relative_to("usr/share/doc") for r in ds._doc_files(tmp_path)]
    source = ds._FileSource("debian", doc, rels, ds._read_text_file)
    got = dict(source.all())
    assert got["debian/linux-doc-6.1/Documentation/PCI/pci.rst"].endswith("How to write PCI drivers.\n")
    assert got["debian/other/page.html"] == "Only rendered here.\n"
    assert len(got) == 4


_FAKE_APT = """#!/bin/sh
# Offline stand-in for apt-get: 'download' builds the package with dpkg-deb -b, after an 'update'.
set -e
case "$1" in
  update) touch "$FAKE_STATE/updated" ;;
  download)
    [ -f "$FAKE_STATE/updated" ] || { echo "E: Unable to locate package $2" >&2; exit 100; }
    [ "$2" = missing-doc ] && { echo "E: Unable to locate package $2" >&2; exit 100; }
    pkg="$FAKE_STATE/build-$2"
    mkdir -p "$pkg/DEBIAN" "$pkg/usr/share/doc/$2/Documentation"
    printf 'Package: %s\\nVersion: 1.0\\nArchitecture: all\\n' "$2" > "$pkg/DEBIAN/control"
    printf 'Maintainer: t <t@example.invalid>\\nDescription: t\\n' >> "$pkg/DEBIAN/control"
    printf 'The %s manual.\\n\\nIt is real enough for a test.\\n' "$2" | gzip -n \\
      > "$pkg/usr/share/doc/$2/Documentation/index.rst.gz"
    dpkg-deb -b -Zgzip "$pkg" "$2_1.0_all.deb" > /dev/null ;;
  *) exit 2 ;;
esac
"""


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb to build a test package")
def test_debian_docs_download_unpack_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt = bin_dir / "apt-get"
    apt.write_text(_FAKE_APT)
    apt.chmod(apt.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.symlink(shutil.which("dpkg-deb"), bin_dir / "dpkg-deb")
    state = tmp_path / "state"
    state.mkdir()
    if os.geteuid() != 0:  # only root runs 'apt-get update' itself
        (state / "updated").touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_STATE", str(state))
    monkeypatch.setenv("ZEPHON_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ds, "_apt_updated", False)
    monkeypatch.setattr(ds, "DEBIAN_DOC_PACKAGES", ("alpha-doc", "missing-doc", "beta-doc"))

    root = ds.ensure_debian_docs(ds.DEBIAN_DOC_PACKAGES)
    assert root == tmp_path / "cache" / "debian-docs"
    assert (root / ds._DEBIAN_MARKER).read_text().split() == ["alpha-doc_1.0_all.deb", "beta-doc_1.0_all.deb"]
    monkeypatch.setenv("PATH", "/nonexistent")  # cached: no apt-get needed any more
    (doc,) = ds.collect_documents(10, debian_docs=True)
    name = doc[0].split("/")[1]
    assert doc == (
        f"debian/{name}/Documentation/index.rst",
        f"The {name} manual.\n\nIt is real enough for a test.\n",
    )
    docs = ds.collect_documents(1000, debian_docs=True)
    assert [i for i, _ in docs[:2]] == [
        "debian/alpha-doc/Documentation/index.rst",
        "debian/beta-doc/Documentation/index.rst",
    ]
    assert docs[2][0].startswith("stdlib/")  # topped up from the standard library


def test_without_apt_falls_back_with_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ZEPHON_DATA_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with caplog.at_level(logging.INFO, logger="zephon_stream.datasets"):
        docs = ds.collect_documents(50_000, debian_docs=True)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "Debian docs unavailable (no apt-get/dpkg-deb): using the Python standard library's text"
    ]
    assert docs and all(i.startswith("stdlib/") for i, _ in docs)
    assert not (tmp_path / "debian-docs").exists()


# ------------------------------------------------------------------------------------------- shards


def test_jsonl_shards_round_trip_in_contiguous_blocks(docs: list[tuple[str, str]], tmp_path: Path) -> None:
    paths = write_jsonl_shards(docs, tmp_path, name="code", shards=3)
    assert [p.name for p in paths] == ["code-00000.jsonl", "code-00001.jsonl", "code-00002.jsonl"]
    records = []
    for p in paths:
        lines = _read_lines(p)
        assert lines, f"{p.name} is empty"
        records += [msgspec.json.decode(line) for line in lines]
    assert [(r["id"], r["text"]) for r in records] == docs
    assert all(list(r) == ["id", "text"] for r in records)
    sizes = [p.stat().st_size for p in paths]
    assert max(sizes) < 2 * min(sizes) + 64 * 1024, sizes  # about equal bytes
    # A custom text field, and more shards than documents: the extra shards are empty.
    few = docs[:2]
    paths = write_jsonl_shards(few, tmp_path / "few", name="x", shards=4, text_field="content")
    got = [msgspec.json.decode(line) for p in paths for line in _read_lines(p)]
    assert got == [{"id": i, "content": t} for i, t in few]
    assert [len(_read_lines(p)) for p in paths].count(0) == 2


def test_zst_shards_are_multi_frame_of_whole_lines(docs: list[tuple[str, str]], tmp_path: Path) -> None:
    frame_bytes = 16 * 1024
    paths = write_jsonl_shards(
        docs, tmp_path, name="prose", shards=2, compress="zst", frame_bytes=frame_bytes
    )
    assert [p.name for p in paths] == ["prose-00000.jsonl.zst", "prose-00001.jsonl.zst"]
    records = []
    for p in paths:
        frames = _frames(p)
        assert len(frames) >= 3, f"{p.name} has {len(frames)} frame(s)"
        for content, size in frames:
            assert size == len(content), "content size is in each frame header"
            assert content.endswith(b"\n"), "a frame ends at a line boundary"
            lines = content.splitlines(keepends=True)
            assert len(content) <= frame_bytes or len(lines) == 1
            records += [msgspec.json.decode(line) for line in lines]  # every line decodes on its own
        assert b"".join(c for c, _ in frames) == b"".join(_read_lines(p))
    assert [(r["id"], r["text"]) for r in records] == docs
    # An empty shard is one empty frame, still a valid zstd stream.
    (empty,) = write_jsonl_shards([], tmp_path / "empty", name="e", shards=1, compress="zst")
    assert _frames(empty) == [(b"", 0)]


def test_shard_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compress"):
        write_jsonl_shards([], tmp_path, name="x", shards=1, compress="gzip")
    with pytest.raises(ValueError, match="shards"):
        write_jsonl_shards([], tmp_path, name="x", shards=0)


# ---------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_training_is_deterministic(docs: list[tuple[str, str]], tmp_path: Path) -> None:
    a = ds.train_tokenizer(docs, tmp_path / "a" / "tokenizer.json", vocab_size=1024)
    b = ds.train_tokenizer(list(reversed(docs)), tmp_path / "b.json", vocab_size=1024)
    assert hashlib.sha256(Path(a).read_bytes()).digest() == hashlib.sha256(Path(b).read_bytes()).digest()
    tok = Tokenizer.from_file(a)
    assert tok.get_vocab_size() == 1024
    eos = tok.token_to_id("<|endoftext|>")
    assert eos == 0
    sample = "Return the value of the attribute. café — naïve ✓\n    def f(x):\n        return x\n"
    enc = tok.encode(sample + "<|endoftext|>")
    assert enc.ids[-1] == eos and eos not in enc.ids[:-1]
    assert len(enc.ids) < len(sample.encode()) // 2  # merges learned from the text
    assert tok.decode(enc.ids) == sample
    assert tok.decode(enc.ids, skip_special_tokens=False) == sample + "<|endoftext|>"


def test_tokenizer_is_the_same_in_a_fresh_single_threaded_process(
    docs: list[tuple[str, str]], tmp_path: Path
) -> None:
    small = docs[:40]
    here = ds.train_tokenizer(small, tmp_path / "here.json", vocab_size=600)
    code = (
        "import sys, msgspec\nfrom tools import corpus as ds\n"
        "docs = [tuple(d) for d in msgspec.json.decode(open(sys.argv[1], 'rb').read())]\n"
        "ds.train_tokenizer(docs, sys.argv[2], vocab_size=600)\n"
    )
    (tmp_path / "docs.json").write_bytes(msgspec.json.encode(small))
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "docs.json"), str(tmp_path / "there.json")],
        check=True,
        env=env,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],  # the repository root, where tools/ is
    )
    assert Path(here).read_bytes() == (tmp_path / "there.json").read_bytes()


# --------------------------------------------------------------------------------------------- demo


def test_build_demo_is_idempotent(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    demo = ds.build_demo(out, min_bytes=300_000, debian_docs=False)
    assert Path(demo.root) == out.resolve()
    assert set(demo.sources) == {"prose", "code"}
    assert demo.origin == {"prose": "stdlib-docstrings", "code": "stdlib"}
    assert sum(demo.bytes.values()) >= 300_000
    prose = [Path(p) for p in demo.shards["prose"]]
    code = [Path(p) for p in demo.shards["code"]]
    assert all(p.name.endswith(".jsonl.zst") and p.parent == Path(demo.sources["prose"]) for p in prose)
    assert all(p.name.endswith(".jsonl") and p.parent == Path(demo.sources["code"]) for p in code)
    n_prose = sum(len(_read_lines(p)) for p in prose)
    assert n_prose == demo.docs["prose"] > 0
    first = msgspec.json.decode(_read_lines(prose[0])[0])
    assert first["id"].startswith("stdlib-docstrings/") and len(first["text"]) >= 40
    assert Tokenizer.from_file(demo.tokenizer).get_vocab_size() > 1000
    stamps = {p: p.stat().st_mtime_ns for p in [*prose, *code, Path(demo.tokenizer)]}

    again = ds.build_demo(out, min_bytes=300_000, debian_docs=False)
    assert again == demo
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps, "a second build rewrote files"

    Path(demo.shards["code"][0]).unlink()  # an incomplete build is rebuilt
    rebuilt = ds.build_demo(out, min_bytes=300_000, debian_docs=False)
    assert rebuilt == demo and Path(demo.shards["code"][0]).is_file()


def test_unusable_cache_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("ZEPHON_DATA_CACHE", str(not_a_dir / "cache"))
    with caplog.at_level(logging.WARNING, logger="zephon_stream.datasets"):
        assert ds.ensure_debian_docs() is None
    (record,) = caplog.records
    assert record.getMessage().startswith("Debian docs unavailable (")
