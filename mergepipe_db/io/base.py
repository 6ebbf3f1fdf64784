"""The byte-store interface and `open_store`, which picks an implementation by the location's URI scheme.

A location is a URI (``file:///data/m.safetensors``) or a plain path (local). Implementations are named in
`SCHEMES` by module and class and imported only when first used (as pyiceberg's `load_file_io` picks a
FileIO), so choosing a store costs no import of numpy or a cloud client.
"""

from __future__ import annotations

import importlib
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from mergepipe_db.errors import StaleSourceError, UnsupportedStorageError

if TYPE_CHECKING:
    import numpy as np

    from mergepipe_db.core.plan import FileStamp

Location = str | Path

#: URI scheme -> "module:class" of its `ByteStore`; a location without a scheme is a local path
SCHEMES: dict[str, str] = {
    "file": "mergepipe_db.io.local:LocalStore",
    "s3": "mergepipe_db.io.s3:S3Store",
}

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_stores: dict[str, ByteStore] = {}
_stores_lock = threading.Lock()


class Stat(NamedTuple):
    """A stored object's size in bytes and its version: what changes when its content may have (the
    modification time in ns for a local file; for an object store an integer derived from its ETag,
    `io.s3.etag_version`, so that the catalog's integer column holds either)."""

    size: int
    version: int | str


class RangeSource(Protocol):
    """A counting reader of byte ranges (`io.local.RangeReader` is the local one). `bytes_read` counts every
    byte asked for (what a plan charges), `bytes_cached` those of them served from a cache."""

    bytes_read: int
    bytes_cached: int

    def read_aligned(self, path: str, offset: int, arr: np.ndarray, pos: int, n: int) -> None: ...

    def read_into(self, path: str, offset: int, buf: memoryview) -> None: ...

    def read(self, path: str, offset: int, length: int) -> bytearray: ...

    def close(self) -> None: ...

    def __enter__(self) -> RangeSource: ...

    def __exit__(self, *exc: object) -> None: ...


class InputFile(Protocol):
    """One object open for a few reads (a header, a tensor's pieces for a check): its `size`, and whether it
    is a `regular` file (an object store's objects always are)."""

    size: int
    regular: bool

    def read(self, offset: int, n: int) -> bytes: ...

    def pieces(self, offset: int, n: int, piece: int) -> Iterator[memoryview]: ...

    def close(self) -> None: ...

    def __enter__(self) -> InputFile: ...

    def __exit__(self, *exc: object) -> None: ...


class OutputFile(Protocol):
    """One object written front to back; `finish` makes it whole (and durable with fsync), `abort` drops
    the handle after a failure. `size`: its length when opened (0 but for an appender)."""

    size: int

    @property
    def direct(self) -> bool: ...

    def write(self, mv: memoryview) -> None: ...

    def finish(self, *, fsync: bool = True) -> None: ...

    def abort(self) -> None: ...


class ByteStore(ABC):
    """Where checkpoint and output bytes live. Every read and write of a checkpoint's or an output's files
    goes through one of these; the methods take locations of this store."""

    scheme: str

    @abstractmethod
    def stat(self, location: Location) -> Stat:
        """Size and version; FileNotFoundError where nothing is stored at `location`."""

    @abstractmethod
    def range_reader(self, *, random: bool) -> RangeSource:
        """A reader of byte ranges of this store's objects that counts what it reads; `random`: no
        read-ahead (ranges chosen by a plan), else sequential use is expected."""

    @abstractmethod
    def sequential_reader(self, location: Location, pool: Any, *, cuts: Iterable[int] = (), depth: int = 2
                          ) -> Any:
        """One object read front to back in pieces ahead of the caller (ingest), into `pool`'s buffers."""

    @abstractmethod
    def read_ahead(self, pool: Any) -> Any:
        """Ranges asked for ahead and taken in order later, read in between (ingest's base blocks)."""

    @abstractmethod
    def open_input(self, location: Location) -> InputFile:
        """`location` open for a few reads (raises OSError as opening a file does)."""

    @abstractmethod
    def read_small(self, location: Location, limit: int) -> bytes:
        """At most `limit` bytes from the start of a small side object (a JSON file)."""

    @abstractmethod
    def sha256(self, location: Location) -> str:
        """Hex sha256 of a whole object."""

    @abstractmethod
    def writer(self, location: Location, *, exclusive: bool = True, direct: bool = False, hasher: Any = None
               ) -> OutputFile:
        """A new object written front to back (`exclusive`: FileExistsError if it exists); `hasher`
        (hashlib-like) is fed every byte in order; `direct` asks to bypass caches where the store can."""

    @abstractmethod
    def appender(self, location: Location) -> OutputFile:
        """An output file opened (or created) for appending at its end; its `size` is the length it had (an
        append-only store file such as the packed block store's; the caller serializes appenders)."""

    @abstractmethod
    def write_new(self, location: Location, data: bytes) -> None:
        """Create `location` (FileExistsError if it exists) holding `data`, durably."""

    @abstractmethod
    def sync(self, location: Location) -> None:
        """Make an object written by other means (a copied side file), or a directory's entries, durable."""

    @abstractmethod
    def publish(self, staging: Location, final: Location) -> None:
        """Make the finished `staging` visible at `final`, atomically and durably (FileNotFoundError where
        `staging` is gone)."""

    def drop_behind(self, location: Location, *, unknown: bool) -> Any:
        """An object with `advance(pos)` and `close()` that keeps a front-to-back read of `location` from
        filling a cache (the local store drops the pages read; elsewhere nothing to do)."""
        return _NoDrop()

    def absolute(self, location: Location) -> str:
        """The location as the catalog records it (a resolved path; a URI as given)."""
        return str(location)


class _NoDrop:
    def advance(self, pos: int) -> None:
        pass

    def close(self) -> None:
        pass


class MultiReader:
    """A `RangeSource` over every store: each path's ranges go to the range reader of the store holding it
    (made on first use), so a merge may read a local base and experts in object storage. `bytes_read`,
    `bytes_cached` and `reads` add up those of its readers."""

    def __init__(self, *, random: bool) -> None:
        self._random = random
        self._by_scheme: dict[str, RangeSource] = {}
        self._by_path: dict[str, RangeSource] = {}
        self._lock = threading.Lock()

    def _reader(self, path: str) -> RangeSource:
        r = self._by_path.get(path)
        if r is None:
            scheme = scheme_of(path)
            with self._lock:
                r = self._by_scheme.get(scheme)
                if r is None:
                    r = self._by_scheme[scheme] = open_store(path).range_reader(random=self._random)
                self._by_path[path] = r
        return r

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in list(self._by_scheme.values()))

    @property
    def bytes_cached(self) -> int:
        return sum(r.bytes_cached for r in list(self._by_scheme.values()))

    @property
    def reads(self) -> int:
        return sum(getattr(r, "reads", 0) for r in list(self._by_scheme.values()))

    def read_aligned(self, path: str, offset: int, arr: np.ndarray, pos: int, n: int) -> None:
        self._reader(path).read_aligned(path, offset, arr, pos, n)

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        self._reader(path).read_into(path, offset, buf)

    def read_aligned_many(self, path: str, ranges: list[tuple[int, Any, int, int]]) -> None:
        """`read_aligned` of each (offset, arr, pos, n) of `path`: all at once where its store can (S3: the
        requests in flight together), else one after another."""
        r = self._reader(path)
        many = getattr(r, "read_aligned_many", None)
        if many is not None:
            many(path, ranges)
            return
        for off, arr, pos, n in ranges:
            r.read_aligned(path, off, arr, pos, n)

    def read(self, path: str, offset: int, length: int) -> bytearray:
        return self._reader(path).read(path, offset, length)

    def close(self) -> None:
        for r in self._by_scheme.values():
            r.close()

    def __enter__(self) -> MultiReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def range_reader(*, random: bool) -> MultiReader:
    """A counting range reader for locations of any store (`MultiReader`)."""
    return MultiReader(random=random)


def as_path(location: Location) -> Any:
    """`location` as a path object: a local `Path`, or for an object store's URI an `io.s3.ObjectPath` (with
    ``/``, `name`, `suffix`, `parent`, and `str` giving the URI back)."""
    if isinstance(location, Path):
        return location
    text = str(location)
    if scheme_of(text) == "s3":
        from mergepipe_db.io.s3 import object_path

        return object_path(text)
    if scheme_of(text) != "file":
        open_store(text)  # UnsupportedStorageError
    return Path(text)


def is_remote(location: Location) -> bool:
    """Whether `location` lies in an object store (not a local path or ``file://`` URI)."""
    return scheme_of(location) != "file"


def scheme_of(location: Location) -> str:
    """The URI scheme of `location`, lower-case; ``file`` for a plain path."""
    if isinstance(location, Path):
        return "file"
    location = str(location)  # an io.s3.ObjectPath
    m = _URI.match(location)
    return m.group(1).lower() if m else "file"


def open_store(location: Location) -> ByteStore:
    """The byte store holding `location`, by its URI scheme (`SCHEMES`; a plain path is local).

    Raises UnsupportedStorageError for a scheme not in `SCHEMES`."""
    scheme = scheme_of(location)
    store = _stores.get(scheme)
    if store is not None:
        return store
    target = SCHEMES.get(scheme)
    if target is None:
        known = ", ".join(f"{s}://" for s in sorted(SCHEMES))
        raise UnsupportedStorageError(f"unsupported storage scheme {scheme}:// in {str(location)!r}; "
                                      f"supported: {known} and plain paths")
    module, _, cls = target.partition(":")
    with _stores_lock:
        if scheme not in _stores:
            _stores[scheme] = getattr(importlib.import_module(module), cls)()
        return _stores[scheme]


def check_fresh(stamps: Iterable[FileStamp]) -> None:
    """Raise StaleSourceError for the first file whose size or version (mtime; an object's ETag) changed since
    ingest."""
    for s in stamps:
        try:
            st = open_store(s.path).stat(s.path)
        except FileNotFoundError as e:
            raise StaleSourceError(f"source file {s.path} is gone since it was ingested") from e
        if st.size != s.size or st.version != s.mtime_ns:
            what = "ETag" if scheme_of(s.path) != "file" else "mtime"
            raise StaleSourceError(
                f"source file {s.path} changed since it was ingested (size {s.size} -> {st.size}, "
                f"{what} changed: {st.version != s.mtime_ns}); re-ingest it or restore it"
            )
