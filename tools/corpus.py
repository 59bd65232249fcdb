"""The demo corpus: real English text and a tokenizer for the demo, examples, tests and benchmarks.

This is a tool of the repository, not part of the installed package: it runs ``apt-get download``.

Nothing here generates text and nothing needs a model hub. The text comes from:

a) the Debian documentation packages ``linux-doc-6.1`` and ``python3.11-doc`` (the Linux kernel's
   Documentation/ tree and the Python 3.11 manual, about 50 MB of English prose), fetched once with
   ``apt-get download`` and unpacked with ``dpkg-deb -x`` into a cache directory;
b) the Python standard library's own source files, which exist on every machine with Python.

``collect_documents`` reads (a) and tops up with (b); shards are written with the library's public
``zephon_stream.formats.write_jsonl_shards``; ``train_tokenizer`` trains a byte-level BPE deterministically;
``build_demo`` puts a small mixture dataset plus its tokenizer in one directory, reusing what is there.

The cache directory is ``$ZEPHON_DATA_CACHE``, else ``$XDG_CACHE_HOME/zephon-stream``, else
``~/.cache/zephon-stream``; the Debian documents live in ``<cache>/debian-docs``.

Command line (from the repository root): ``python -m tools.corpus OUT_DIR [--min-mb N] [--no-debian-docs]``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import gzip
import hashlib
import html.parser
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import msgspec

try:
    from tqdm import tqdm
except ImportError:  # the `progress` extra is not installed: the build logs its steps instead
    tqdm = None

from zephon_stream.formats.jsonl_zst import atomic_write, write_jsonl_shards

__all__ = [
    "DEBIAN_DOC_PACKAGES",
    "DemoPaths",
    "build_demo",
    "cache_dir",
    "collect_documents",
    "debian_documents",
    "debian_download_bytes",
    "debian_fetch_notice",
    "ensure_debian_docs",
    "html_to_text",
    "stdlib_docstring_documents",
    "stdlib_documents",
    "train_tokenizer",
    "write_jsonl_shards",
]

log = logging.getLogger("zephon_stream.datasets")

#: Debian packages whose documentation is the preferred source of English prose.
DEBIAN_DOC_PACKAGES: tuple[str, ...] = ("linux-doc-6.1", "python3.11-doc")

#: Files larger than this (UTF-8 bytes) are cut into sections at paragraph boundaries.
MAX_DOC_BYTES = 64 * 1024

_SKIP_DIRS = frozenset({"_static", "_images", "_downloads", "__pycache__", "site-packages", "dist-packages"})
_DEBIAN_MARKER = ".zephon-docs-v1"  # bump when the selection of kept files changes
_DEMO_MARKER = ".zephon-demo.json"
_DEMO_FORMAT = 1
_APT_TIMEOUT_S = 600


# --------------------------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """The cache root: ``$ZEPHON_DATA_CACHE``, else ``$XDG_CACHE_HOME/zephon-stream``, else ``~/.cache/…``."""
    explicit = os.environ.get("ZEPHON_DATA_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "zephon-stream"


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (created if absent) for the block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


class _Progress:
    """A tqdm bar on a terminal; one log line per finished piece anywhere else (never a `\\r` in a log)."""

    def __init__(self, desc: str, total: float | None, unit: str = "step") -> None:
        self.desc = desc
        self.bar = None  # off a terminal (disable=None), or without tqdm: log lines
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(desc=desc, total=total, unit=unit, unit_scale=unit == "B", file=sys.stderr, leave=False,
                            dynamic_ncols=True)

    def doing(self, what: str) -> None:
        """Say what runs now (a terminal shows it beside the bar)."""
        if self.bar is not None:
            self.bar.set_postfix_str(what)

    def total(self, total: float) -> None:
        """Set the total once it is known."""
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def advance(self, n: float = 1) -> None:
        """Count `n` more on the bar, with nothing logged (for many small pieces)."""
        if self.bar is not None:
            self.bar.update(n)

    def done(self, what: str, n: float = 1) -> None:
        if self.bar is None:
            log.info("%s: %s", self.desc, what)
        else:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------- text handling


def _decode(raw: bytes) -> str | None:
    """UTF-8 text of ``raw``, or None when it is binary (has a NUL byte) or not valid UTF-8."""
    if b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


_BLOCK_TAGS = frozenset(
    {
        "address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt", "figcaption", "figure",
        "footer", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "main", "nav", "ol", "p", "pre",
        "section", "table", "tbody", "td", "th", "thead", "tr", "ul",
    }
)  # fmt: skip
_WS = re.compile(r"[ \t\n\r\f]+")  # HTML whitespace: not \xa0 (&nbsp;)
_DROP_TAGS = frozenset({"script", "style", "head", "title", "noscript", "template"})


class _TextExtractor(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._drop = 0
        self._pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _DROP_TAGS:
            self._drop += 1
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")
            if tag == "pre":
                self._pre += 1

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _DROP_TAGS:
            self._drop = max(0, self._drop - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n")
            if tag == "pre":
                self._pre = max(0, self._pre - 1)

    def handle_data(self, data: str) -> None:
        if self._drop:
            return
        self.parts.append(data if self._pre else _WS.sub(" ", data))


def html_to_text(markup: str) -> str:
    """Plain text of an HTML page: tags stripped, script/style/head dropped, one blank line between blocks."""
    parser = _TextExtractor()
    parser.feed(markup)
    parser.close()
    lines: list[str] = []
    for line in "".join(parser.parts).split("\n"):
        # Text outside <pre> has its whitespace collapsed, so a line with deeper indent comes from <pre>.
        line = line.rstrip() if line.startswith(("  ", "\t")) else line.strip()
        if line or (lines and lines[-1]):
            lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + ("\n" if lines else "")


def _cut(text: str, max_bytes: int, seps: Sequence[str]) -> list[str]:
    """Pieces of ``text`` (concatenating to it) of at most ``max_bytes`` UTF-8 bytes, cut after ``seps[0]``
    where possible, else after the next separator, else anywhere on a character boundary."""
    if len(text.encode("utf-8")) <= max_bytes:
        return [text]
    if not seps:
        raw = text.encode("utf-8")
        out: list[str] = []
        start = 0
        while start < len(raw):
            end = min(start + max_bytes, len(raw))
            while end < len(raw) and (raw[end] & 0xC0) == 0x80:  # never cut inside a character
                end -= 1
            out.append(raw[start:end].decode("utf-8"))
            start = end
        return out
    sep, rest = seps[0], seps[1:]
    units = [u + sep for u in text.split(sep)]
    units[-1] = units[-1][: -len(sep)]
    out = []
    current: list[str] = []
    size = 0
    for unit in units:
        n = len(unit.encode("utf-8"))
        if n > max_bytes:
            if current:
                out.append("".join(current))
                current, size = [], 0
            out.extend(_cut(unit, max_bytes, rest))
            continue
        if size + n > max_bytes and current:
            out.append("".join(current))
            current, size = [], 0
        current.append(unit)
        size += n
    if current:
        out.append("".join(current))
    return [p for p in out if p]


def _sections(doc_id: str, text: str, max_bytes: int = MAX_DOC_BYTES) -> list[tuple[str, str]]:
    """``[(doc_id, text)]``, or ``[(doc_id#0000, part), ...]`` when the text is over ``max_bytes``."""
    parts = _cut(text, max_bytes, ("\n\n", "\n"))
    if len(parts) == 1:
        return [(doc_id, text)]
    return [(f"{doc_id}#{i:04d}", part) for i, part in enumerate(parts)]


def _rank(doc_id: str) -> bytes:
    """A stable pseudo-random rank: taking documents in rank order samples a tree evenly."""
    return hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest()


# ----------------------------------------------------------------------------------- file sources


class _FileSource:
    """A sorted list of files under ``root``, each read as zero or more ``(doc_id, text)`` documents."""

    def __init__(self, prefix: str, root: Path, files: Sequence[Path], read: Callable[[Path], str | None]):
        self.prefix, self.root, self.files, self._read = prefix, root, list(files), read

    def docs_of(self, rel: Path) -> list[tuple[str, str]]:
        text = self._read(self.root / rel)
        if not text or not text.strip():
            return []
        return _sections(f"{self.prefix}/{rel.as_posix().removesuffix('.gz')}", text)

    def all(self) -> Iterator[tuple[str, str]]:
        for rel in self.files:
            yield from self.docs_of(rel)

    def sample(self, budget: int) -> tuple[list[tuple[str, str]], int]:
        """Whole files, taken in a stable pseudo-random order (so evenly across the tree) until they hold
        ``budget`` UTF-8 bytes, returned sorted by id. A smaller budget gives a subset."""
        chosen: list[tuple[str, str]] = []
        total = 0
        for rel in sorted(self.files, key=lambda r: _rank(r.as_posix())):
            if total >= budget:
                break
            docs = self.docs_of(rel)
            chosen += docs
            total += sum(len(t.encode("utf-8")) for _, t in docs)
        chosen.sort(key=lambda d: d[0])
        return chosen, total


def _read_text_file(path: Path) -> str | None:
    """UTF-8 text of a (possibly gzipped) file, HTML reduced to plain text; None for binary or non-UTF-8."""
    try:
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    text = _decode(raw)
    if text is not None and path.name.removesuffix(".gz").lower().endswith((".html", ".htm")):
        text = html_to_text(text)
    return text


# ----------------------------------------------------------------------------- source (a): Debian docs


def _debian_root() -> Path:
    return cache_dir() / "debian-docs"


def _wanted_doc_file(rel: Path, html_roots: set[Path]) -> bool:
    """Is this file of an unpacked documentation package English prose worth reading?"""
    parts = rel.parts
    if any(p in _SKIP_DIRS for p in parts):
        return False
    name = rel.name.removesuffix(".gz")
    if name.startswith(("genindex", "changelog", "search.", "py-modindex", "copyright")):
        return False
    suffix = Path(name).suffix.lower()
    if suffix in (".html", ".htm"):
        # A Sphinx page is a rendering of its <html>/_sources/*.rst.txt: read the source, not the page.
        return not any(r in rel.parents for r in html_roots)
    if suffix in (".rst", ".txt"):
        return True
    # Extension-less text in the kernel's Documentation/ tree (ABI entries, Changes, CodingStyle, ...).
    return suffix == "" and "Documentation" in parts and name not in ("Makefile", "Kconfig")


def _doc_files(root: Path) -> list[Path]:
    """Relative paths of the wanted documentation files under an unpacked tree, sorted."""
    files = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    html_roots = {Path(*rel.parts[: rel.parts.index("_sources")]) for rel in files if "_sources" in rel.parts}
    return [rel for rel in files if _wanted_doc_file(rel, html_roots)]


def _run(cmd: list[str], cwd: Path) -> bool:
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=_APT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("%s failed: %s", " ".join(cmd), exc)
        return False
    if proc.returncode != 0:
        log.debug("%s exited %d: %s", " ".join(cmd), proc.returncode, proc.stderr.strip()[-500:])
    return proc.returncode == 0


_apt_updated = False


def _apt_download(apt: str, package: str, dest: Path) -> bool:
    """``apt-get download PACKAGE`` into ``dest``; on failure, as root, ``apt-get update`` once and retry."""
    global _apt_updated
    if _run([apt, "download", package], dest):
        return True
    if _apt_updated or os.geteuid() != 0:
        return False
    _apt_updated = True
    return _run([apt, "update"], dest) and _run([apt, "download", package], dest)


def debian_download_bytes(packages: Sequence[str] = DEBIAN_DOC_PACKAGES) -> dict[str, int]:
    """Each package's download size in bytes, as ``apt-get download --print-uris`` says (no network,
    no download); empty when apt cannot say (no apt, or the packages are unknown)."""
    apt = shutil.which("apt-get")
    if not apt:
        return {}
    try:
        out = subprocess.run([apt, "download", "--print-uris", *packages], capture_output=True, text=True,
                             timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    sizes: dict[str, int] = {}
    for line in out.splitlines():  # 'URI' name_version_all.deb SIZE SHA256:...
        parts = line.split()
        if len(parts) >= 3 and parts[2].isdigit():
            sizes[parts[1].split("_", 1)[0]] = int(parts[2])
    return sizes


def debian_fetch_notice(packages: Sequence[str] = DEBIAN_DOC_PACKAGES) -> str | None:
    """What the first build will fetch, and where it goes; None when the documents are already cached."""
    if have_debian_docs():
        return None
    sizes = debian_download_bytes(packages)
    if not sizes:
        return (f"The Debian documentation packages ({', '.join(packages)}) cannot be fetched here (apt-get "
                "cannot see them): the demo uses the Python standard library's text instead.")
    return (f"Fetching the Debian documentation packages {', '.join(sizes)} once with apt-get download "
            f"({sum(sizes.values()) / 1e6:.1f} MB from the Debian mirrors), unpacked into {_debian_root()} "
            "(about 41 MB kept). Set ZEPHON_DATA_CACHE to put it elsewhere; `make clean` leaves it, "
            "delete that directory to remove it.")


def _prune_to_unique_docs(tree: Path) -> None:
    """Delete every file of ``tree`` but the wanted documents, and of identical texts all but the first
    by path (the kernel's Documentation/*.rst and its html/_sources copies)."""
    keep: set[Path] = set()
    seen: set[bytes] = set()
    progress = _Progress("Debian docs: keep one copy of each text", None, unit="file")
    progress.doing("listing the unpacked files")
    files = _doc_files(tree)
    progress.total(len(files))
    progress.doing("reading and comparing the texts")
    try:
        for rel in files:
            progress.advance()
            text = _read_text_file(tree / rel)
            if not text or not text.strip():
                continue
            digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
            if digest not in seen:
                seen.add(digest)
                keep.add(rel)
        progress.doing("deleting the other files")
        for p in sorted(tree.rglob("*"), reverse=True):  # children before their directory
            if p.is_symlink() or (p.is_file() and p.relative_to(tree) not in keep):
                p.unlink()
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        progress.done(f"{len(keep)} of {len(files)} files kept", 0)
    finally:
        progress.close()


def ensure_debian_docs(packages: Sequence[str] = DEBIAN_DOC_PACKAGES) -> Path | None:
    """The unpacked Debian documentation, downloaded (``apt-get download``) and unpacked (``dpkg-deb -x``)
    into ``<cache>/debian-docs`` the first time; None, after logging one line, when it cannot be had.

    Only the files that are read are kept (HTML renderings of shipped sources, images, device-tree
    YAML and duplicate texts are pruned). A package that fails is left out if another one succeeds.
    """
    try:
        return _ensure_debian_docs(packages)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("Debian docs unavailable (%s): using the Python standard library's text", exc)
        return None


def _ensure_debian_docs(packages: Sequence[str]) -> Path | None:
    root = _debian_root()
    if (root / _DEBIAN_MARKER).is_file():
        return root
    with _locked(root.with_name("debian-docs.lock")):
        if (root / _DEBIAN_MARKER).is_file():  # another process finished while this one waited
            return root
        apt, dpkg = shutil.which("apt-get"), shutil.which("dpkg-deb")
        if not apt or not dpkg:
            log.warning(
                "Debian docs unavailable (no apt-get/dpkg-deb): using the Python standard library's text"
            )
            return None
        t0 = time.monotonic()
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="debian-docs-", dir=root.parent) as tmp:
            debs, tree = Path(tmp, "debs"), Path(tmp, "tree")
            debs.mkdir()
            debs.chmod(0o777)  # apt's sandbox user must be able to write there, or apt warns
            got = _download(apt, packages, debs)
            unpacked = _unpack(dpkg, sorted(debs.glob("*.deb")), tree)
            if not got or not unpacked or not tree.is_dir():
                log.warning(
                    "Debian docs unavailable (apt-get download %s / dpkg-deb -x failed): "
                    "using the Python standard library's text",
                    " ".join(packages),
                )
                return None
            _prune_to_unique_docs(tree)
            (tree / _DEBIAN_MARKER).write_text("\n".join(unpacked) + "\n", encoding="utf-8")
            if root.exists():
                shutil.rmtree(root)
            os.replace(tree, root)
        log.info("Debian docs %s unpacked to %s in %.1f s", " ".join(got), root, time.monotonic() - t0)
        return root


def _unpack(dpkg: str, debs: list[Path], tree: Path) -> list[str]:
    """``dpkg-deb -x`` each package into ``tree``, with progress; the names of those unpacked."""
    progress = _Progress("Debian docs: unpack", len(debs), unit="package")
    unpacked = []
    try:
        for d in debs:
            progress.doing(f"dpkg-deb -x {d.name}")
            if _run([dpkg, "-x", str(d), str(tree)], d.parent):
                unpacked.append(d.name)
                progress.done(d.name)
    finally:
        progress.close()
    return unpacked


def _download(apt: str, packages: Sequence[str], dest: Path) -> list[str]:
    """``apt-get download`` each package into ``dest``, with progress; the names that succeeded."""
    sizes = debian_download_bytes(packages)
    progress = _Progress("Debian docs download", sum(sizes.values()) or None, unit="B" if sizes else "package")
    got = []
    try:
        for p in packages:
            progress.doing(f"apt-get download {p}")
            if _apt_download(apt, p, dest):
                got.append(p)
                progress.done(f"{p} ({sizes.get(p, 0) / 1e6:.1f} MB)", sizes.get(p, 1))
    finally:
        progress.close()
    return got


def _debian_source(download: bool = True) -> _FileSource | None:
    root = ensure_debian_docs() if download else _debian_root()
    if root is None or not (root / _DEBIAN_MARKER).is_file():
        return None
    doc = Path("usr", "share", "doc")
    # ids: debian/<package dir>/<path>, e.g. debian/linux-doc-6.1/Documentation/PCI/pci.rst
    files = [r.relative_to(doc) for r in _doc_files(root) if doc in r.parents]
    return _FileSource("debian", root / doc, files, _read_text_file)


def have_debian_docs() -> bool:
    """Whether the Debian documentation is already downloaded and unpacked in the cache."""
    return (_debian_root() / _DEBIAN_MARKER).is_file()


def debian_documents(*, download: bool = True) -> Iterator[tuple[str, str]]:
    """Every Debian documentation document ``(doc_id, text)``, sorted by path; nothing when unavailable.

    With ``download=False`` only an existing cache is read.
    """
    src = _debian_source(download)
    return src.all() if src else iter(())


# ------------------------------------------------------------------------------ source (b): stdlib


def _stdlib_files(suffixes: tuple[str, ...]) -> tuple[Path, list[Path]]:
    """The standard library's directory and its files with these suffixes (sorted, no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        found += [Path(dirpath, n).relative_to(root) for n in filenames if n.endswith(suffixes)]
    return root, sorted(rel for rel in found if not (root / rel).is_symlink())


def _stdlib_source() -> _FileSource:
    root, files = _stdlib_files((".py", ".txt", ".rst"))
    return _FileSource("stdlib", root, files, _read_text_file)


def stdlib_documents() -> Iterator[tuple[str, str]]:
    """The standard library's source files (and bundled .txt/.rst), whole or in sections, sorted by path."""
    return _stdlib_source().all()


def _docstrings(source: str) -> str:
    """The module, class and function docstrings (40+ characters) of a Python source, a blank line apart."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes in old test files
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return ""
    out: list[str] = []
    stack: list[ast.AST] = [tree]
    while stack:  # statements only: docstrings are never inside expressions
        node = stack.pop()
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                out.append(doc.strip())
        for field in ("handlers", "finalbody", "orelse", "body"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                stack.extend(reversed(children))
    return "\n\n".join(out) + ("\n" if out else "")


def _read_docstrings(path: Path) -> str | None:
    text = _read_text_file(path)
    return _docstrings(text) if text else None


def _stdlib_docstring_source() -> _FileSource:
    root, files = _stdlib_files((".py",))
    return _FileSource("stdlib-docstrings", root, files, _read_docstrings)


def stdlib_docstring_documents() -> Iterator[tuple[str, str]]:
    """The standard library's English prose: each module's docstrings as one document, sorted by path."""
    return _stdlib_docstring_source().all()


# ----------------------------------------------------------------------------------------- selection


def _take(docs: Iterable[tuple[str, str]], budget: int) -> list[tuple[str, str]]:
    """Documents holding about ``budget`` UTF-8 bytes, sampled evenly by a stable hash of the id; id order."""
    chosen: list[tuple[str, str]] = []
    total = 0
    for doc in sorted(docs, key=lambda d: _rank(d[0])):
        if total >= budget:
            break
        chosen.append(doc)
        total += len(doc[1].encode("utf-8"))
    return sorted(chosen, key=lambda d: d[0])


def collect_documents(min_bytes: int, *, debian_docs: bool = True, download: bool = True) -> list[tuple[str, str]]:
    """Real English text: ``(doc_id, text)`` pairs holding at least ``min_bytes`` UTF-8 bytes if the
    sources have that much, else all they have.

    Each document is a file's text (or a section of a file over 64 KiB, cut at blank lines), decoded as
    UTF-8; binary and non-UTF-8 files are skipped. The Debian documentation comes first (downloaded once
    into the cache when ``debian_docs`` is true; if that fails one line is logged), then the standard
    library's source files. Within a source whole files are taken in a stable pseudo-random order, so
    the text spreads evenly over the tree, and returned sorted by path: the same call gives the same
    list, and a smaller ``min_bytes`` gives a subset of it. With ``download=False`` only an existing
    cache of the Debian documentation is read (no network).
    """
    out: list[tuple[str, str]] = []
    total = 0
    sources = [_debian_source(download), _stdlib_source()] if debian_docs else [_stdlib_source()]
    for src in sources:
        if src is not None and total < min_bytes:
            docs, n = src.sample(min_bytes - total)
            out += docs
            total += n
    return out


# ----------------------------------------------------------------------------------------- tokenizer

#: Training reads at most this many UTF-8 bytes of the given documents (sampled evenly): a few seconds.
TOKENIZER_TRAIN_BYTES = 8 * 1024 * 1024


def train_tokenizer(
    docs: Sequence[tuple[str, str]],
    out_path: str | os.PathLike[str],
    *,
    vocab_size: int = 8192,
    eos_token: str = "<|endoftext|>",
    max_train_bytes: int = TOKENIZER_TRAIN_BYTES,
) -> str:
    """Train a byte-level BPE on ``docs`` and save it as ``out_path`` (tokenizer.json); returns the path.

    Deterministic: the same documents give a byte-identical file, whatever the thread count. Training
    reads at most ``max_train_bytes`` of text, sampled evenly by document id, in id order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample = _take(docs, max_train_bytes)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text for _, text in sample), trainer=trainer, length=len(sample))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, [tok.to_str(pretty=True).encode("utf-8")])
    return str(out)


# ---------------------------------------------------------------------------------------------- demo


class DemoPaths(msgspec.Struct, frozen=True):
    """Where ``build_demo`` put things: ``sources`` maps a source name to its shard directory."""

    root: str
    tokenizer: str
    sources: dict[str, str]
    shards: dict[str, list[str]]
    docs: dict[str, int]
    bytes: dict[str, int]
    origin: dict[str, str]


#: name -> (share of min_bytes, shards, compress)
_DEMO_SOURCES: dict[str, tuple[float, int, str]] = {"prose": (0.75, 4, "zst"), "code": (0.25, 3, "none")}


def build_demo(
    out_dir: str | os.PathLike[str], *, min_bytes: int = 4 * 1024 * 1024, debian_docs: bool = True
) -> DemoPaths:
    """A small mixture dataset under ``out_dir`` and its tokenizer; reused when already built.

    * ``prose/prose-0000N.jsonl.zst``: Debian documentation (Linux kernel and Python manuals) as
      multi-frame zstd, or the standard library's docstrings when those docs cannot be had;
    * ``code/code-0000N.jsonl``: the standard library's source files, plain JSON Lines;
    * ``tokenizer.json``: a byte-level BPE trained on both.

    ``min_bytes`` is the total text: three quarters prose, a quarter code. A marker file written
    last records what was built; a later call with the same arguments returns it without work.
    """
    root = Path(out_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    marker = root / _DEMO_MARKER
    request = {"format": _DEMO_FORMAT, "min_bytes": min_bytes, "debian_docs": debian_docs}
    with _locked(root / ".zephon-demo.lock"):
        found = _read_demo_marker(marker, request)
        if found is not None:
            return found
        marker.unlink(missing_ok=True)  # whatever is there now is not a finished build of this request
        progress = _Progress("demo dataset", 5)
        try:
            chosen, origin = _choose_demo_docs(min_bytes, debian_docs, progress)
            sources: dict[str, str] = {}
            shard_paths: dict[str, list[str]] = {}
            for src, (_, n_shards, compress) in _DEMO_SOURCES.items():
                d = root / src
                if d.exists():
                    shutil.rmtree(d)
                docs = chosen[src][0]
                paths = write_jsonl_shards(
                    docs, d, name=src, shards=min(n_shards, max(1, len(docs))), compress=compress
                )
                sources[src] = str(d)
                shard_paths[src] = [str(p) for p in paths]
                progress.done(f"{src}: {len(paths)} shards written")
            progress.doing("training the tokenizer")
            tokenizer = train_tokenizer(chosen["prose"][0] + chosen["code"][0], root / "tokenizer.json")
            progress.done("tokenizer trained")
        finally:
            progress.close()
        result = DemoPaths(
            root=str(root),
            tokenizer=tokenizer,
            sources=sources,
            shards=shard_paths,
            docs={k: len(v[0]) for k, v in chosen.items()},
            bytes={k: v[1] for k, v in chosen.items()},
            origin=origin,
        )
        atomic_write(
            marker, [msgspec.json.format(msgspec.json.encode({"request": request, "paths": result}))]
        )
        return result


def _choose_demo_docs(
    min_bytes: int, debian_docs: bool, progress: _Progress
) -> tuple[dict[str, tuple[list[tuple[str, str]], int]], dict[str, str]]:
    """The demo's documents per source (and their bytes), and where each source's text came from."""
    prose_budget = int(min_bytes * _DEMO_SOURCES["prose"][0])
    progress.doing("Debian documentation")
    debian = _debian_source() if debian_docs else None
    prose, n_prose = debian.sample(prose_budget) if debian else ([], 0)
    origin = {"prose": "debian-docs", "code": "stdlib"}
    if n_prose < prose_budget:
        more, n_more = _stdlib_docstring_source().sample(prose_budget - n_prose)
        origin["prose"] = "debian-docs+stdlib-docstrings" if prose else "stdlib-docstrings"
        prose, n_prose = prose + more, n_prose + n_more
    progress.done(f"prose: {len(prose)} documents from {origin['prose']}")
    code, n_code = _stdlib_source().sample(min_bytes - n_prose)
    progress.done(f"code: {len(code)} documents from the standard library")
    return {"prose": (prose, n_prose), "code": (code, n_code)}, origin


def _read_demo_marker(marker: Path, request: dict[str, object]) -> DemoPaths | None:
    try:
        saved = msgspec.json.decode(marker.read_bytes())
        paths = msgspec.convert(saved["paths"], DemoPaths)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError):
        return None
    if saved.get("request") != request:
        return None
    files = [paths.tokenizer, *(p for ps in paths.shards.values() for p in ps)]
    if not all(Path(p).is_file() for p in files) or Path(paths.root).resolve() != marker.parent.resolve():
        return None
    return paths


# ----------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zephon_stream._datasets", description=build_demo.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--min-mb", type=float, default=4.0, help="total text in MiB (default 4)")
    parser.add_argument("--no-debian-docs", action="store_true", help="use only the standard library's text")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    t0 = time.monotonic()
    demo = build_demo(
        args.out_dir, min_bytes=int(args.min_mb * 1024 * 1024), debian_docs=not args.no_debian_docs
    )
    print(f"demo dataset in {demo.root} ({time.monotonic() - t0:.1f} s)")
    for src, directory in demo.sources.items():
        on_disk = sum(Path(p).stat().st_size for p in demo.shards[src])
        print(
            f"  {src:6s} {demo.docs[src]:6d} docs  {demo.bytes[src] / 1e6:7.2f} MB text  "
            f"{len(demo.shards[src])} shards  {on_disk / 1e6:7.2f} MB on disk  "
            f"from {demo.origin[src]}  -> {directory}"
        )
    print(f"  tokenizer {demo.tokenizer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
