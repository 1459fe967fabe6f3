"""Learned files of the block store: token sequences a speculation source learned in a
namespace (the suffix source's global index of earlier outputs), one file per source and
namespace beside the KV blocks: ``<root>/<ns>/learned/<name>.lrn`` (the layout is
``storage.format.encode_learned``).

They are kept like manifests: written atomically (temp name, write, fsync, rename, folder
fsync) under the shared folder lock, 0600 in 0700 folders (they hold token ids of private
conversations), and read whole and verified by the header hash, which covers every byte.
A file read whole and found wrong is removed, and :class:`LearnedDamaged` says why; one
that cannot be ours (larger than any learned file, from a newer mlxkv) or that names
another namespace raises it too, and is left where it is. ``clear(ns)`` removes them with
the namespace; scan and GC leave them alone.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from mlxkv.storage import diskio
from mlxkv.storage import format as fmt
from mlxkv.storage.folder import LEARNED_DIR, LEARNED_RE, LEARNED_TMP_RE, folder_lock
from mlxkv.storage.format import FormatError, Learned, UnknownVersion
from mlxkv.storage.keys import check_namespace

# The largest file decode_learned can accept: a prefix, a bounded header body and its hash.
MAX_LEARNED_BYTES = fmt.PREFIX_SIZE + fmt.MAX_HEADER + 8


class LearnedDamaged(FormatError):
    """A learned file that is not used: ``removed`` says whether it was deleted (read whole
    and found wrong) or left alone (not provably ours, or another namespace's)."""

    def __init__(self, path: str, reason: str, removed: bool):
        super().__init__(f"{diskio.printable(path)}: {reason}")
        self.path, self.reason, self.removed = diskio.printable(path), reason, removed


@dataclass(frozen=True)
class LearnedFile:
    """A learned file as a directory listing sees it (nothing read)."""

    ns: str
    name: str
    path: str
    nbytes: int
    mtime: float


class LearnedFiles:
    """The learned files under a cache folder ``root`` (see the module docstring)."""

    def __init__(self, root: str, durable: bool) -> None:
        self.root = root
        self.durable = durable

    def path(self, ns: str, name: str) -> str:
        if not isinstance(name, str) or not LEARNED_RE.match(f"{name}.lrn"):
            raise ValueError(f"learned file name {name!r} must be 1-32 lowercase letters, digits "
                             "or '-', starting with a letter")
        return os.path.join(self.root, check_namespace(ns), LEARNED_DIR, f"{name}.lrn")

    def put(self, ns: str, name: str, learned: Learned) -> int:
        """Write ``learned`` as namespace ``ns``'s file ``name`` (replacing the last one
        atomically: a crash leaves the old file or the new one, never a mix); the bytes
        written. OSError, or ``storage.keys.CacheFolderError``, when it cannot be written."""
        if learned.ns != ns:
            raise ValueError(f"sequences learned in {learned.ns!r} stored under {ns!r}")
        path = self.path(ns, name)
        data = fmt.encode_learned(learned)
        with folder_lock(self.root, shared=True):
            diskio.atomic_write(self.root, path, data, self.durable)
        return len(data)

    def get(self, ns: str, name: str, remove: bool = True) -> Learned | None:
        """Namespace ``ns``'s learned file ``name``, verified; None when there is none.
        :class:`LearnedDamaged` when it cannot be used (removed if read whole and wrong,
        unless ``remove`` is False: a look that changes nothing)."""
        path = self.path(ns, name)
        try:
            fd = diskio.open_ro(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LearnedDamaged(path, exc.strerror or str(exc), False) from exc
        try:
            size = os.fstat(fd).st_size
            if size > MAX_LEARNED_BYTES:
                raise LearnedDamaged(path, f"{size} bytes: larger than any learned file", False)
            data = os.pread(fd, size + 1, 0)
        except OSError as exc:
            raise LearnedDamaged(path, exc.strerror or str(exc), False) from exc
        finally:
            os.close(fd)
        try:
            learned = fmt.decode_learned(data)
        except UnknownVersion as exc:
            raise LearnedDamaged(path, str(exc), False) from exc
        except FormatError as exc:  # read whole and wrong: ours, and damaged
            raise LearnedDamaged(path, str(exc), remove and diskio.unlink_under(self.root, path)) from exc
        if learned.ns != ns:
            raise LearnedDamaged(path, f"learned in another namespace ({learned.ns!r})", False)
        return learned

    def remove(self, ns: str, name: str) -> bool:
        return diskio.unlink_under(self.root, self.path(ns, name))

    def files(self, ns: str | None = None) -> list[LearnedFile]:
        """The learned files (of ``ns``, or of every namespace), from the folder listing."""
        out = []
        names = [check_namespace(ns)] if ns is not None else [
            dirent.name for dirent in diskio.scandir(self.root) if dirent.is_dir(follow_symlinks=False)]
        for name in sorted(names):
            d = os.path.join(self.root, name, LEARNED_DIR)
            if not (_real_dir(os.path.join(self.root, name)) and _real_dir(d)):
                continue
            for dirent in diskio.scandir(d):
                if not LEARNED_RE.match(dirent.name):
                    continue
                try:
                    st = dirent.stat(follow_symlinks=False)
                except OSError:
                    continue
                if dirent.is_file(follow_symlinks=False):
                    out.append(LearnedFile(name, dirent.name[:-4], dirent.path, st.st_size, st.st_mtime))
        return out

    def clear_namespace(self, ns_dir: str) -> int:
        """Remove the learned files of the namespace folder ``ns_dir`` (and their temp files),
        then the folder once empty (the caller holds the exclusive folder lock)."""
        d = os.path.join(ns_dir, LEARNED_DIR)
        if not (_real_dir(ns_dir) and _real_dir(d)):
            return 0
        removed = 0
        for dirent in diskio.scandir(d):
            if LEARNED_RE.match(dirent.name) or LEARNED_TMP_RE.match(dirent.name):
                removed += diskio.unlink_under(self.root, dirent.path)
        diskio.quiet(os.rmdir, d)
        return removed


def _real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


__all__ = ["MAX_LEARNED_BYTES", "LearnedDamaged", "LearnedFile", "LearnedFiles"]
