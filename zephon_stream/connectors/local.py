"""A local directory as an object store: the embedded default.

Keys are paths under `root`, which need not exist: it lists as empty until the first put
creates it (and any directory a key needs). A key that would leave the root (`..`, an absolute path, or a
symlink that points outside) is refused with `AccessDenied`. Blocking file calls run in a
worker thread so the event loop never waits on the disk.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from zephon_stream.connectors.base import ObjectInfo, StoreStatistics
from zephon_stream.engine import threads
from zephon_stream.errors import AccessDenied, AlreadyExists, ConfigError, ConnectorError, ObjectNotFound

__all__ = ["LocalStore"]


class LocalStore:
    """Objects are files under `root`; keys are their '/'-separated relative paths."""

    # Reads of a split one part at a time: each is a thread hand-off for a page-cache copy, and the
    # kernel reads ahead of a sequential reader. Overlapping 4 of them cost the image bench 5-10% of
    # its throughput (a window's tasks, and twice the reads and parse calls) for nothing.
    overlap_reads = False

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        if self.root.exists() and not self.root.is_dir():  # every call would fail (NotADirectoryError for a key)
            raise ConfigError(f"file://{self.root}/ is a file, not a folder: a file:// store or prefix names a folder")
        self._requests = 0
        self._bytes_read = 0
        self._bytes_written = 0

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str, links: bool = True) -> Path:
        """The key's path; with `links`, refused if its symlinks lead outside the root (`_read` checks
        the file it opened instead: the same rule, without resolving the path a component at a time)."""
        if not key or key.startswith("/") or "\\" in key or ".." in key.split("/"):
            raise AccessDenied(f"key {key!r} is not a relative path inside {self.root}")
        path = self.root / key
        if links:
            self._inside(key, path.resolve())
        return path

    def _inside(self, key: str, real: Path | str) -> None:
        real = str(real)
        if real != str(self.root) and not real.startswith(str(self.root).rstrip(os.sep) + os.sep):
            raise AccessDenied(f"key {key!r} resolves to {real}, outside the store root {self.root}")

    def _opened(self, key: str, fd: int, path: Path) -> None:
        """Refuse the file behind `fd` if it lies outside the root: where the kernel says it is
        (/proc/self/fd, one readlink), else the path resolved as `_path` does (no /proc)."""
        try:
            real: Path | str = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = path.resolve()
        self._inside(key, real)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await threads.run_sync(self._list, prefix)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        self._requests += 1
        if not self.root.exists():
            return []  # like an S3 prefix that holds nothing yet; the first put creates the directories
        if not self.root.is_dir():
            raise ObjectNotFound(f"store root {self.root} is not a directory: check the file:// URI")
        out = []
        for dirpath, _dirs, files in os.walk(self.root, followlinks=False):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if rel.startswith(prefix):
                    out.append(self._info(rel))
        return sorted(out, key=lambda o: o.key)

    def _info(self, key: str) -> ObjectInfo:
        try:
            st = self._path(key).stat()
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object {key!r} under {self.root}") from exc
        return ObjectInfo(key=key, size=st.st_size, etag=f"{st.st_mtime_ns:x}-{st.st_size:x}")

    async def head(self, key: str) -> ObjectInfo:
        self._requests += 1
        return await threads.run_sync(self._info, key)

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        data = await threads.run_sync(self._read, key, start, end)
        self._requests += 1
        self._bytes_read += len(data)
        return data

    def _read(self, key: str, start: int, end: int | None) -> bytes:
        path = self._path(key, links=False)
        try:
            with open(path, "rb") as f:
                self._opened(key, f.fileno(), path)
                f.seek(start)
                return f.read() if end is None else f.read(max(0, end - start))
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object {key!r} under {self.root}") from exc
        except IsADirectoryError as exc:
            raise ObjectNotFound(f"{key!r} under {self.root} is a directory, not an object") from exc

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        await threads.run_sync(self._put, key, data, if_none_match)
        self._requests += 1
        self._bytes_written += len(data)

    def _put(self, key: str, data: bytes, if_none_match: bool) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(data):x}.tmp")
        for last in (False, True):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(data)
                break
            except FileNotFoundError:  # a delete took the folder as it emptied (`_delete`): once more
                if last:
                    raise
            except OSError as exc:  # a full disk, a read-only or vanished mount: no partial file stays
                with contextlib.suppress(OSError):  # read-only: unlinking a missing file is EROFS, not ENOENT
                    tmp.unlink(missing_ok=True)
                raise self._write_error(key, len(data), exc) from exc
        try:
            if if_none_match:
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError as exc:
                    raise AlreadyExists(f"object {key!r} already exists under {self.root}") from exc
            else:
                os.replace(tmp, path)
        except OSError as exc:  # no hard links here (EPERM), a folder that needs a block on a full disk
            raise self._write_error(key, len(data), exc) from exc
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def _write_error(self, key: str, size: int, exc: OSError) -> ConnectorError:
        return ConnectorError(f"cannot write {key!r} under {self.root}: {exc.strerror or exc} ({size:,} bytes)")

    async def delete(self, key: str) -> None:
        self._requests += 1
        await threads.run_sync(self._delete, key)

    def _delete(self, key: str) -> None:
        """Remove the object, and the folders it leaves empty up to the root (as S3 has no folders:
        a refit prefix's retention left a `vN/` folder behind for every version it removed)."""
        path = self._path(key)
        path.unlink(missing_ok=True)
        folder = path.parent
        while folder != self.root and self.root in folder.parents:
            _remove_orphans(folder)
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): the folders above are not empty either
                break
            folder = folder.parent

    async def copy(self, src_key: str, dst_key: str) -> None:
        data = await self.read(src_key)
        await self.put(dst_key, data)

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            requests=self._requests, bytes_read=self._bytes_read, bytes_written=self._bytes_written
        )

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> LocalStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()




_TMP = re.compile(r"\..+\.(\d+)\.[0-9a-f]+\.tmp")  # `_put`'s temporary file: .{name}.{pid}.{id}.tmp


def _remove_orphans(folder: Path) -> None:
    """Remove the temporary files in `folder` that a killed process left (`_put` writes one, then
    renames it): their pid is not alive. Retention deletes only the keys a version names, so a
    relay or publisher killed mid-put left them for good, and a collected version's folder with them."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = _TMP.fullmatch(name)
        if m is None or _alive(int(m[1])):
            continue
        with contextlib.suppress(OSError):
            (folder / name).unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True
