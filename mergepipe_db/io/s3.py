"""S3-compatible object storage as a byte store (`S3Store`, for ``s3://bucket/key`` locations), on obstore.

Configuration comes from the standard environment — ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` (default ``us-east-1``) — overridden by
storage options (`set_storage_options`: the CLI's ``--storage-option KEY=VALUE``, ``storage_options={...}`` in
Python). An endpoint that starts with ``http://`` is allowed with no further setting.

Reads: `S3RangeReader` splits each range it is asked for into ranged GETs of at most `PART_BYTES` and issues
them `IN_FLIGHT` at a time on a shared thread pool, copying each answer into the caller's buffer (the merge's
own buffers). Ranges are never widened or merged with their neighbours here: what a caller asks for is what
the server sends, and `bytes_read` counts it where each request is issued (budget soundness, as for files).
The first answer for an object fixes its ETag; later requests carry ``If-Match`` with it, so an object
replaced during a merge is a StaleSourceError rather than a mix of two versions. Ingest reads an object front
to back with several pieces in flight (`S3SequentialReader`).

A location's version (`stat`) is derived from its ETag (`etag_version`: a 60-bit integer of the ETag's
sha256) so that the catalog's integer version column holds it as it holds a file's mtime.

Errors from the store are typed (`errors.StoreError` and its subclasses), one line each: no such bucket or
key, access denied, endpoint unreachable, throttling after retries.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime
import hashlib
import os
import queue
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from mergepipe_db.core.names import show_path
from mergepipe_db.errors import (
    StaleSourceError,
    StorageConfigError,
    StoreAccessDeniedError,
    StoreError,
    StoreNotFoundError,
    StoreThrottledError,
    StoreUnreachableError,
)
from mergepipe_db.io.base import ByteStore, Location, Stat
from mergepipe_db.io.local import ALIGN, RecyclingPool, SequentialReader
from mergepipe_db.io.ranges import coalesce

#: the most bytes one ranged GET asks for (a range larger than this is several requests, in flight together)
PART_BYTES = 4 << 20
#: ranged GETs in flight at once per store
IN_FLIGHT = 16
#: multipart upload part size for outputs
UPLOAD_PART_BYTES = 8 << 20
#: the largest object one server-side copy (CopyObject) may make: S3's limit (MinIO's too)
COPY_MAX_BYTES = 5 << 30

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: storage options this store takes (``--storage-option KEY=VALUE``), besides obstore's own S3 config keys
OPTION_KEYS = ("endpoint", "access_key_id", "secret_access_key", "session_token", "region", "max_retries",
               "retry_timeout", "allow_http")
_ENV = {"endpoint": "AWS_ENDPOINT_URL", "access_key_id": "AWS_ACCESS_KEY_ID",
        "secret_access_key": "AWS_SECRET_ACCESS_KEY", "session_token": "AWS_SESSION_TOKEN", "region": "AWS_REGION"}

_options: dict[str, str] = {}
_options_lock = threading.Lock()


def set_storage_options(options: Mapping[str, str] | None) -> None:
    """Use `options` (keys of `OPTION_KEYS`; they win over the environment) for the S3 clients made from now on;
    None or empty: the environment alone. StorageConfigError for an unknown key."""
    opts = {str(k).lower(): str(v) for k, v in (options or {}).items()}
    unknown = sorted(set(opts) - set(OPTION_KEYS))
    if unknown:
        raise StorageConfigError(f"unknown storage option {unknown[0]!r}; known: {', '.join(OPTION_KEYS)}")
    with _options_lock:
        if opts != _options:
            _options.clear()
            _options.update(opts)
            store = _STORE
            if store is not None:
                store.reset()


def storage_options() -> dict[str, str]:
    """The storage options in force in this process (`set_storage_options`; not the environment's): what a
    distributed merge hands its workers with each task."""
    with _options_lock:
        return dict(_options)


def parse_options(pairs: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (the CLI's ``--storage-option``) as a dict; StorageConfigError for a malformed one."""
    out: dict[str, str] = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key.strip():
            raise StorageConfigError(f"--storage-option takes KEY=VALUE, got {p!r}")
        out[key.strip().lower()] = value
    set_storage_options(out)  # validates the keys
    set_storage_options(None)
    return out


class ObjectPath(PurePosixPath):
    """An ``s3://bucket/key`` location with the path operations a checkpoint layout uses (``/``, `name`,
    `suffix`, `parent`); `str` gives the URI back. Never a local path: ``os.stat`` of it finds nothing."""

    def __str__(self) -> str:
        text = super().__str__()
        return "s3://" + text[4:] if text.startswith("s3:/") else text

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    @property
    def bucket(self) -> str:
        return self.parts[1] if len(self.parts) > 1 else ""

    @property
    def key(self) -> str:
        return "/".join(self.parts[2:])


def parse_uri(location: Location) -> tuple[str, str]:
    """(bucket, key) of an ``s3://bucket/key`` URI (the key may be empty: the whole bucket).
    StorageConfigError for a malformed one (no bucket, a bad bucket name, empty or ``..`` key segments)."""
    text = str(location)
    if not text.lower().startswith("s3://"):
        raise StorageConfigError(f"not an s3:// URI: {show_path(text)}")
    rest = text[5:]
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise StorageConfigError(f"malformed s3:// URI {show_path(text)}: bad bucket name {bucket!r} "
                                 "(3-63 characters: lower-case letters, digits, '.', '-')")
    key = key.rstrip("/")
    if key:
        segs = key.split("/")
        if any(s in ("", ".", "..") for s in segs) or any(ord(c) < 0x20 for c in key) or "\\" in key:
            raise StorageConfigError(f"malformed s3:// URI {show_path(text)}: empty, '.' or '..' key segments")
    return bucket, key


def object_path(location: Location) -> ObjectPath:
    """`location` as an `ObjectPath` (validated, `parse_uri`)."""
    if isinstance(location, ObjectPath):
        return location
    bucket, key = parse_uri(location)
    return ObjectPath(f"s3://{bucket}/{key}" if key else f"s3://{bucket}")


def etag_version(etag: str | None) -> int:
    """The integer version of an object with `etag` (what the catalog's version column holds): 60 bits of the
    ETag's sha256, so a replaced object (new ETag) has another version."""
    return int(hashlib.sha256((etag or "").encode()).hexdigest()[:15], 16)


def translate(e: BaseException, where: str) -> BaseException:
    """An obstore error as one of ours: FileNotFoundError for a missing key, FileExistsError for a failed
    create-only put, else a typed StoreError with a one-line message naming `where`."""
    from obstore import exceptions as ox

    text = str(e)
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    if isinstance(e, (ox.AlreadyExistsError, ox.PreconditionError)) and "If-Match" not in text:
        return FileExistsError(f"{where}: already exists")
    if isinstance(e, (FileNotFoundError, ox.NotFoundError)):
        return FileNotFoundError(f"{where}: no such key")
    if "NoSuchBucket" in text:
        return StoreNotFoundError(f"{where}: no such bucket")
    if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or " 403 " in text or "AccessDenied" in text \
            or "SignatureDoesNotMatch" in text or "InvalidAccessKeyId" in text:
        return StoreAccessDeniedError(f"{where}: access denied (check the credentials and the bucket's policy)")
    if "SlowDown" in text or " 503 " in text or " 429 " in text or "Throttl" in text:
        return StoreThrottledError(f"{where}: the store kept throttling requests (503 Slow Down) after retries")
    if "error sending request" in text or "onnect" in text or "timed out" in text.lower() or "dns" in text.lower():
        return StoreUnreachableError(f"{where}: endpoint unreachable ({_endpoint_shown()})")
    return StoreError(f"{where}: {first[:300]}")


def _endpoint_shown() -> str:
    with _options_lock:
        return _options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or "AWS default endpoint"


def _config() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(obstore S3 config, client options, retry config) from the environment and the storage options."""
    with _options_lock:
        opts = dict(_options)
    cfg: dict[str, Any] = {}
    for key, env in _ENV.items():
        value = opts.get(key) or os.environ.get(env)
        if value:
            cfg[key] = value
    cfg.setdefault("region", os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    if not cfg.get("access_key_id") or not cfg.get("secret_access_key"):
        raise StorageConfigError("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                                 "--storage-option access_key_id=... secret_access_key=...)")
    endpoint = cfg.get("endpoint", "")
    if endpoint and not re.match(r"^https?://[^/\s]+", endpoint):
        raise StorageConfigError(f"S3 endpoint {endpoint!r} is not an http:// or https:// URL")
    client = {"allow_http": endpoint.startswith("http://") or opts.get("allow_http", "").lower() in ("1", "true")}
    retries = int(opts.get("max_retries", "4"))
    timeout = float(opts.get("retry_timeout", "30"))
    retry = {"max_retries": retries, "retry_timeout": datetime.timedelta(seconds=timeout),
             "backoff": {"init_backoff": datetime.timedelta(milliseconds=50),
                         "max_backoff": datetime.timedelta(seconds=2), "base": 2}}
    cfg["virtual_hosted_style_request"] = False
    return cfg, client, retry


class S3RangeReader:
    """Reads byte ranges of objects with ranged GETs (at most `PART_BYTES` each, `IN_FLIGHT` at once),
    counting every byte it asks the server for where the request is issued (`bytes_read`; `requests`).
    Thread-safe. `bytes_cached` is always 0 (no cache here)."""

    def __init__(self, store: S3Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._etags: dict[str, str] = {}
        self.bytes_read = 0
        self.bytes_cached = 0
        self.reads = 0

    def _get(self, location: str, start: int, n: int, dst: memoryview) -> None:
        """One ranged GET of [start, start + n) into `dst` (n bytes), counted."""
        import obstore

        client, key = self._store.client_for(location)
        with self._lock:
            self.bytes_read += n
            self.reads += 1
            etag = self._etags.get(location)
        opts: dict[str, Any] = {"range": (start, start + n)}
        if etag is not None:
            opts["if_match"] = etag
        try:
            got = obstore.get(client, key, options=opts)
            data = got.bytes()
        except Exception as e:  # noqa: BLE001 - translated
            from obstore import exceptions as ox

            if isinstance(e, ox.PreconditionError):
                raise StaleSourceError(f"source object {location} changed while it was read (ETag)") from None
            raise translate(e, location) from None
        if etag is None:
            with self._lock:
                self._etags.setdefault(location, got.meta["e_tag"] or "")
        if len(data) != n:
            raise StaleSourceError(f"source object {location} is shorter than the catalog says (truncated?)")
        dst[:] = memoryview(data)

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill `buf` with the bytes at [offset, offset + len(buf)) of object `path`."""
        buf = buf.cast("B") if buf.format != "B" else buf
        n = len(buf)
        if n == 0:
            return
        if n <= PART_BYTES:
            self._get(path, offset, n, buf)
            return
        futures = [self._store.pool.submit(self._get, path, offset + a, min(PART_BYTES, n - a),
                                           buf[a:a + min(PART_BYTES, n - a)])
                   for a in range(0, n, PART_BYTES)]
        for f in futures:
            f.result()

    def read_aligned(self, path: str, offset: int, arr: np.ndarray, pos: int, n: int) -> None:
        """Fill ``arr[pos:pos + n]`` with the bytes at [offset, offset + n) of `path` (only those bytes are
        asked for; `arr`'s neighbouring bytes are left as they are)."""
        self.read_into(path, offset, memoryview(arr[pos:pos + n]))  # type: ignore[arg-type]

    def read_aligned_many(self, path: str, ranges: list[tuple[int, np.ndarray, int, int]]) -> None:
        """`read_aligned` of each (offset, arr, pos, n): every part of every range requested at once (up to
        `IN_FLIGHT` in flight), e.g. the scattered blocks a plan selects in one tensor."""
        futures = []
        for offset, arr, pos, n in ranges:
            buf = memoryview(arr[pos:pos + n])  # type: ignore[arg-type]
            for a in range(0, n, PART_BYTES):
                k = min(PART_BYTES, n - a)
                futures.append(self._store.pool.submit(self._get, path, offset + a, k, buf[a:a + k]))
        for f in futures:
            f.result()

    def read(self, path: str, offset: int, length: int) -> bytearray:
        buf = bytearray(length)
        self.read_into(path, offset, memoryview(buf))
        return buf

    def close(self) -> None:
        pass

    def __enter__(self) -> S3RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class S3SequentialReader(SequentialReader):
    """`io.local.SequentialReader` over an object: the same pieces and views, each piece a ranged GET, up to
    `IN_FLIGHT` pieces requested at once (`depth` finished pieces wait for the caller)."""

    def __init__(self, store: S3Store, location: str, pool: RecyclingPool, *, cuts: Iterable[int] = (),
                 depth: int = 2) -> None:
        self.path = str(location)
        self._pool = pool
        self._size = store.stat(location).size
        self._cuts = list(cuts)
        self._pieces: queue.Queue = queue.Queue(maxsize=max(depth, 4))
        self._stop = threading.Event()
        self._reader = S3RangeReader(store)  # type: ignore[assignment]
        self._store = store
        self._buf: memoryview = memoryview(b"")
        self._at = 0
        self._done = False
        self._thread = threading.Thread(target=self._run, name="mergepipe-s3-sequential-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        window: collections.deque[tuple[concurrent.futures.Future, memoryview]] = collections.deque()
        try:
            for off, n in self._spans():
                if self._stop.is_set():
                    return
                arr = self._pool.take(n + 2 * ALIGN)
                pos = off % ALIGN
                view = memoryview(arr)[pos:pos + n]  # type: ignore[arg-type]  # numpy arrays are buffers
                window.append((self._store.pool.submit(self._reader.read_into, self.path, off, view), view))
                while len(window) >= IN_FLIGHT // 2:
                    f, v = window.popleft()
                    f.result()
                    self._pieces.put(v)
            while window:
                f, v = window.popleft()
                f.result()
                self._pieces.put(v)
            self._pieces.put(self._END)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by read()
            for f, _v in window:
                f.cancel()
            self._pieces.put(e)


class S3ReadAhead:
    """`io.local.ReadAhead` for objects: ranges asked for ahead (`ask`) and taken in the same order (`take`),
    each run of adjacent ranges one read (split into parallel ranged GETs), several runs in flight."""

    def __init__(self, store: S3Store, pool: RecyclingPool) -> None:
        self._store = store
        self._pool = pool
        self._reader = S3RangeReader(store)
        self._asked: collections.deque[tuple[str, int, int]] = collections.deque()
        self._runs: collections.deque[tuple[concurrent.futures.Future, list[memoryview]]] = collections.deque()
        self._pending: collections.deque[memoryview] = collections.deque()

    def ask(self, path: str, offset: int, n: int) -> None:
        self._asked.append((path, offset, n))
        if sum(x[2] for x in self._asked) >= self._pool.room:
            self._issue()

    def _issue(self) -> None:
        class _R:
            __slots__ = ("path", "offset", "nbytes")

        items = []
        for p, o, n in self._asked:
            r = _R()
            r.path, r.offset, r.nbytes = p, o, n
            items.append(r)
        self._asked.clear()
        for lo, n, members in coalesce(items, limit=self._pool.room, file=lambda r: r.path):
            buf = np.empty(n, np.uint8)
            mv = memoryview(buf)  # type: ignore[arg-type]
            views = [mv[r.offset - lo:r.offset - lo + r.nbytes] for r in members]
            self._runs.append((self._store.pool.submit(self._reader.read_into, members[0].path, lo, mv), views))

    def take(self) -> memoryview:
        if not self._pending:
            if not self._runs:
                self._issue()
            f, views = self._runs.popleft()
            f.result()
            self._pending.extend(views)
        return self._pending.popleft()

    def close(self) -> None:
        for f, _v in self._runs:
            f.cancel()
        self._runs.clear()


class S3InputFile:
    """An object open for a few reads (a header, a tensor's pieces)."""

    regular = True

    def __init__(self, store: S3Store, location: str) -> None:
        self.path = location
        self._store = store
        self.size = store.stat(location).size
        self._reader = S3RangeReader(store)

    def read(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        return bytes(self._reader.read(self.path, offset, n)) if n else b""

    def pieces(self, offset: int, n: int, piece: int) -> Iterator[memoryview]:
        end = min(offset + n, self.size)
        while offset < end:
            k = min(piece, end - offset)
            yield memoryview(self._reader.read(self.path, offset, k))
            offset += k

    def close(self) -> None:
        pass

    def __enter__(self) -> S3InputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class S3OutputFile:
    """An object written front to back as a multipart upload (obstore's writer, parts of `UPLOAD_PART_BYTES`),
    visible only once `finish` completes it; `abort` abandons the upload. `hasher` is fed every byte in order.
    With `exclusive`, FileExistsError where the key exists when opened (keys written here are unique to an
    attempt, so no one else writes them)."""

    size = 0
    direct = False

    def __init__(self, store: S3Store, location: str, *, exclusive: bool = True, hasher: Any = None) -> None:
        import obstore

        self.path = location
        self._store = store
        self._hasher = hasher
        if exclusive and store.exists(location):
            raise FileExistsError(f"{location}: already exists")
        client, key = store.client_for(location)
        try:
            self._w: Any = obstore.open_writer(client, key, buffer_size=UPLOAD_PART_BYTES)
        except Exception as e:  # noqa: BLE001 - translated
            raise translate(e, location) from None

    def write(self, mv: memoryview) -> None:
        if self._hasher is not None:
            self._hasher.update(mv)
        try:
            # a copy: obstore's writer keeps a reference to the buffer it is given until it uploads it (measured:
            # a buffer changed after `write` returned changed the object), and the caller reuses its buffers
            self._w.write(bytes(mv))
        except Exception as e:  # noqa: BLE001 - translated
            raise translate(e, self.path) from None

    def finish(self, *, fsync: bool = True) -> None:
        try:
            self._w.close()
        except Exception as e:  # noqa: BLE001 - translated
            raise translate(e, self.path) from None

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._w.abort()  # not every writer can: an upload left behind is found by `gc`


class S3Store(ByteStore):
    """Objects in S3-compatible storage, at ``s3://bucket/key`` locations; one obstore client per bucket (made
    on first use, after checking that the bucket answers: a missing bucket, refused credentials or an
    unreachable endpoint fail there, typed)."""

    scheme = "s3"

    def __init__(self) -> None:
        _register(self)
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="mergepipe-s3")
            return self._pool

    def reset(self) -> None:
        """Forget the clients (new storage options)."""
        with self._lock:
            self._clients.clear()

    def client_for(self, location: Location) -> tuple[Any, str]:
        """(obstore client of the bucket, key) for `location`."""
        bucket, key = parse_uri(location)
        with self._lock:
            client = self._clients.get(bucket)
        if client is None:
            client = self._make_client(bucket)
        return client, key

    def _make_client(self, bucket: str) -> Any:
        import obstore
        from obstore.store import S3Store as ObS3Store

        cfg, client_opts, retry = _config()
        try:
            client = ObS3Store(bucket, config=cfg, client_options=client_opts, retry_config=retry)
        except Exception as e:  # noqa: BLE001 - a configuration obstore refuses
            raise StorageConfigError(f"s3://{bucket}: unusable S3 configuration: {str(e).splitlines()[0]}") from None
        try:
            next(iter(obstore.list(client, prefix=None, chunk_size=1)), None)
        except Exception as e:  # noqa: BLE001 - translated
            err = translate(e, f"s3://{bucket}")
            if isinstance(err, FileNotFoundError):
                err = StoreNotFoundError(f"s3://{bucket}: no such bucket")
            raise err from None
        with self._lock:
            self._clients.setdefault(bucket, client)
            return self._clients[bucket]

    # -- the ByteStore interface ---------------------------------------------------------------------------

    def stat(self, location: Location) -> Stat:
        """Size and `etag_version` of the object's ETag; FileNotFoundError where there is no such key."""
        import obstore

        client, key = self.client_for(location)
        if not key:
            raise FileNotFoundError(f"{location}: no key (a bucket)")
        try:
            meta = obstore.head(client, key)
        except Exception as e:  # noqa: BLE001 - translated
            raise translate(e, str(location)) from None
        return Stat(int(meta["size"]), etag_version(meta["e_tag"]))

    def exists(self, location: Location) -> bool:
        try:
            self.stat(location)
        except FileNotFoundError:
            return False
        return True

    def range_reader(self, *, random: bool) -> S3RangeReader:
        return S3RangeReader(self)

    def sequential_reader(self, location: Location, pool: Any, *, cuts: Iterable[int] = (), depth: int = 2
                          ) -> S3SequentialReader:
        return S3SequentialReader(self, str(location), pool, cuts=cuts, depth=depth)

    def read_ahead(self, pool: Any) -> S3ReadAhead:
        return S3ReadAhead(self, pool)

    def open_input(self, location: Location) -> S3InputFile:
        return S3InputFile(self, str(location))

    def read_small(self, location: Location, limit: int) -> bytes:
        import obstore

        client, key = self.client_for(location)
        try:
            size = self.stat(location).size
            if size == 0:
                return b""
            return bytes(obstore.get_range(client, key, start=0, length=min(size, limit)))
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - translated
            raise translate(e, str(location)) from None

    def sha256(self, location: Location) -> str:
        h = hashlib.sha256()
        pool = RecyclingPool.for_reads(8 << 20, keep=8)
        reader = S3SequentialReader(self, str(location), pool, depth=4)
        try:
            h.update(reader.read_rest())
        finally:
            reader.close()
        return h.hexdigest()

    def writer(self, location: Location, *, exclusive: bool = True, direct: bool = False, hasher: Any = None
               ) -> S3OutputFile:
        return S3OutputFile(self, str(location), exclusive=exclusive, hasher=hasher)

    def appender(self, location: Location) -> Any:
        raise StorageConfigError(f"{location}: objects cannot be appended to (the packed block store must be local)")

    def write_new(self, location: Location, data: bytes) -> None:
        """Create the object (``If-None-Match: *``): FileExistsError where it exists."""
        import obstore

        client, key = self.client_for(location)
        try:
            obstore.put(client, key, data, mode="create")
        except Exception as e:  # noqa: BLE001 - translated
            raise translate(e, str(location)) from None

    def sync(self, location: Location) -> None:
        """Nothing to do: an object is durable once its put (or upload) completed."""

    def copy(self, src: Location, dst: Location) -> None:
        """Server-side copy of object `src` to `dst` in the same bucket (CopyObject: no bytes pass through this
        process; S3 limits one copy to 5 GiB)."""
        import obstore

        client, src_key = self.client_for(src)
        dst_bucket, dst_key = parse_uri(dst)
        if dst_bucket != parse_uri(src)[0]:
            raise StorageConfigError(f"cannot copy {src} to another bucket ({dst})")
        try:
            obstore.copy(client, src_key, dst_key, overwrite=True)
        except Exception as e:  # noqa: BLE001 - translated
            raise translate(e, str(src)) from None

    def publish(self, staging: Location, final: Location) -> None:
        raise StorageConfigError("object stores have no rename: outputs to s3:// are committed by the catalog "
                                 "(io.s3 outputs), not published by renaming")

    # -- listing and removal (outputs, gc, fsck) -------------------------------------------------------------

    def list(self, prefix: Location) -> list[dict[str, Any]]:
        """Every object under `prefix` (a "directory": ``prefix/...``): [{path (URI), size, e_tag}]."""
        import obstore

        bucket, key = parse_uri(prefix)
        client, _ = self.client_for(prefix)
        out: list[dict[str, Any]] = []
        try:
            for chunk in obstore.list(client, prefix=(key + "/") if key else None):
                for m in chunk:
                    out.append({"path": f"s3://{bucket}/{m['path']}", "size": int(m["size"]), "e_tag": m["e_tag"]})
        except Exception as e:  # noqa: BLE001 - translated
            raise translate(e, str(prefix)) from None
        return out

    def delete(self, location: Location) -> None:
        import obstore

        client, key = self.client_for(location)
        try:
            obstore.delete(client, key)
        except Exception as e:  # noqa: BLE001 - translated
            err = translate(e, str(location))
            if not isinstance(err, FileNotFoundError):
                raise err from None


_STORE: S3Store | None = None


def store() -> S3Store:
    """The process's S3 store (what `io.open_store` returns for ``s3://``)."""
    from mergepipe_db.io.base import open_store

    st = open_store("s3://x")
    assert isinstance(st, S3Store)
    return st


def _register(st: S3Store) -> None:
    global _STORE
    _STORE = st


def local_path_or_object(location: Location) -> Path | ObjectPath:
    """`location` as a path object: an `ObjectPath` for ``s3://``, else a local `Path`."""
    text = str(location)
    if text[:5].lower() == "s3://":
        return object_path(text)
    return Path(location)


# -- outputs: attempt-unique keys, the index as the claim, manifest.json last ------------------------------

#: marks the objects of one merge attempt that are not shards (its staged manifest), and its staging record
ATTEMPT_MARK = ".mergepipe-attempt-"
_ST = ".safetensors"


class AttemptPrefix:
    """Where one merge attempt writes its output in an object store: `prefix`/NAME, where a shard's NAME carries
    the attempt (``model-00001-of-00002.<attempt>.safetensors``: keys unique to the attempt, so an attempt never
    overwrites another's objects) and ``manifest.json`` is staged under a hidden key until the catalog has
    committed (`publish_attempt` writes ``prefix/manifest.json`` last). The index and the base's side files
    keep their names: the index is created with ``If-None-Match: *`` and so claims the prefix (a second merge
    racing for it fails there, before its commit). Used in place of a staging directory: ``/`` gives the
    object's location; `str` is the record of the attempt (``prefix/.mergepipe-attempt-<id>``)."""

    def __init__(self, prefix: Location, attempt: str) -> None:
        self.prefix = object_path(prefix)
        self.attempt = attempt

    def object_name(self, name: str) -> str:
        """The name under the prefix of the output file called `name`."""
        if name.endswith(_ST):
            return f"{name[:-len(_ST)]}.{self.attempt}{_ST}"
        if name == "manifest.json":
            return f"{ATTEMPT_MARK}{self.attempt}.manifest.json"
        return name

    def __truediv__(self, name: str) -> ObjectPath:
        return self.prefix / self.object_name(str(name))

    @property
    def parent(self) -> ObjectPath:
        return self.prefix

    @property
    def name(self) -> str:
        return f"{ATTEMPT_MARK}{self.attempt}"

    def __str__(self) -> str:
        return f"{self.prefix}/{ATTEMPT_MARK}{self.attempt}"

    def __fspath__(self) -> str:
        return str(self)

    def owns(self, name: str) -> bool:
        """Whether the object `name` (under the prefix) is one of this attempt's shards or staged files."""
        return f".{self.attempt}{_ST}" in name or name.startswith(f"{ATTEMPT_MARK}{self.attempt}")

    @classmethod
    def parse(cls, record: str) -> AttemptPrefix | None:
        """The attempt a staging record (`str` of one) names; None for a local staging path."""
        if not record.lower().startswith("s3://") or f"/{ATTEMPT_MARK}" not in record:
            return None
        prefix, _, attempt = record.rpartition(f"/{ATTEMPT_MARK}")
        return cls(prefix, attempt)


def task_attempt(staging: AttemptPrefix, tag: str) -> AttemptPrefix:
    """Where one task attempt of a distributed merge (`mergepipe_db.distributed`) writes its shards: keys
    ``NAME.<tag>.<attempt>.safetensors`` under the output prefix, unique to the task attempt (`tag`: no dots)
    and owned by `staging`'s attempt (its `owns`, so `abandon_attempt` and gc's stray check cover them)."""
    if not tag or "." in tag or "/" in tag:
        raise ValueError(f"bad task attempt tag {tag!r}")
    return AttemptPrefix(staging.prefix, f"{tag}.{staging.attempt}")


def check_copyable(shard_bytes: Iterable[int]) -> None:
    """StorageConfigError where a shard of a distributed merge (its tensor bytes, plus 1 MiB for its header)
    would exceed what one server-side copy makes (`COPY_MAX_BYTES`): checked before anything is written."""
    largest = max(shard_bytes, default=0)
    if largest + (1 << 20) > COPY_MAX_BYTES:
        raise StorageConfigError(f"a distributed merge to s3:// copies each shard server-side, at most "
                                 f"{COPY_MAX_BYTES} bytes, and a shard holds {largest}: give a smaller --shard-size")


def publish_task_shards(staging: AttemptPrefix, task: AttemptPrefix, names: Iterable[str]) -> None:
    """The shards `names` that task attempt `task` wrote, copied (server-side) to the keys `staging`'s index
    names (``NAME.<attempt>.safetensors``)."""
    st = store()
    for name in names:
        st.copy(task / name, staging / name)


def remove_task_attempts(staging: AttemptPrefix, keep: Iterable[str]) -> list[str]:
    """Remove every shard object of `staging`'s task attempts under its prefix (winners', once copied, and
    those of attempts whose worker died) except the names in `keep` (the attempt's own shard keys); returns
    their URIs. Multipart uploads a dead worker left unfinished are not objects: `gc` aborts them."""
    keep = set(keep)
    gone = []
    for n in _names(staging.prefix):
        if n.endswith(f".{staging.attempt}{_ST}") and n not in keep:
            store().delete(staging.prefix / n)
            gone.append(str(staging.prefix / n))
    return gone


def _names(prefix: ObjectPath) -> dict[str, dict[str, Any]]:
    base = str(prefix) + "/"
    return {o["path"][len(base):]: o for o in store().list(prefix)}


def check_output_prefix(out: Location) -> ObjectPath:
    """`--out` in an object store: a prefix (not a whole bucket) under which nothing is stored yet (else
    OutputExistsError: objects cannot be replaced atomically, so an output never shares a prefix)."""
    from mergepipe_db.errors import OutputExistsError

    p = object_path(out)
    if not p.key:
        raise StorageConfigError(f"--out {p}: give a prefix inside the bucket (s3://bucket/prefix)")
    n = len(store().list(p))
    if n:
        raise OutputExistsError(f"output prefix {p} is not empty ({n} objects); choose a new --out")
    return p


def write_index(staging: AttemptPrefix, data: bytes) -> None:
    """Create ``prefix/model.safetensors.index.json`` (create-only): the attempt's claim on the prefix.
    OutputExistsError where another merge got there first."""
    from mergepipe_db.errors import OutputExistsError

    try:
        store().write_new(staging / "model.safetensors.index.json", data)
    except FileExistsError:
        raise OutputExistsError(f"output prefix {staging.prefix} was taken by another merge while this one ran; "
                                "choose another --out") from None


def _index_is_mine(staging: AttemptPrefix, names: dict[str, Any]) -> bool:
    import json

    if "model.safetensors.index.json" not in names:
        return False
    try:
        doc = json.loads(store().read_small(staging / "model.safetensors.index.json", 64 << 20))
        return any(staging.owns(str(v)) for v in doc.get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return False


def attempt_objects(staging: AttemptPrefix) -> list[str]:
    """Every object of `staging`'s attempt under its prefix: its shards and staged manifest, and, where its
    index holds the prefix (the index names its shards), the index and the side files beside it (never a
    published ``manifest.json``)."""
    names = _names(staging.prefix)
    mine = [n for n in names if staging.owns(n)]
    if _index_is_mine(staging, names):
        mine += [n for n in names if "/" not in n and not n.endswith(_ST) and n != "manifest.json"
                 and not n.startswith(ATTEMPT_MARK)]
    return sorted(set(mine))


def abandon_attempt(staging: AttemptPrefix) -> list[str]:
    """Remove what `attempt_objects` lists (an attempt that will not commit); returns their URIs."""
    gone = []
    for n in attempt_objects(staging):
        store().delete(staging.prefix / n)
        gone.append(str(staging.prefix / n))
    return gone


def publish_attempt(staging: AttemptPrefix) -> bool:
    """After the catalog commit: write ``prefix/manifest.json`` (create-only) from the attempt's staged manifest,
    then drop the staged copy. False where there is nothing to do (already published); idempotent, so `gc` can
    roll an interrupted publish forward."""
    st = store()
    staged, final = staging / "manifest.json", staging.prefix / "manifest.json"
    try:
        data = st.read_small(staged, 1 << 30)
    except FileNotFoundError:
        return False
    try:
        st.write_new(final, data)
    except FileExistsError:
        if st.read_small(final, 1 << 30) != data:
            raise
    st.delete(staged)
    return True


def published(prefix: Location) -> bool:
    """Whether ``prefix/manifest.json`` exists (the output is complete for readers of the prefix)."""
    return store().exists(object_path(prefix) / "manifest.json")


def stray_attempts(prefix: Location, owned: set[str]) -> list[AttemptPrefix]:
    """Attempts with objects under `prefix` that no record in `owned` (staging records) names."""
    seen: set[str] = set()
    for n in _names(object_path(prefix)):
        if n.startswith(ATTEMPT_MARK):
            seen.add(n[len(ATTEMPT_MARK):].split(".", 1)[0])
        elif n.endswith(_ST) and n.count(".") >= 2:
            seen.add(n[:-len(_ST)].rsplit(".", 1)[1])
    out = [AttemptPrefix(prefix, a) for a in sorted(seen)]
    return [a for a in out if str(a) not in owned]


# -- multipart uploads left behind (gc): obstore does not list them, so two plain SigV4-signed requests -------


def signed_request(method: str, location: Location, query: dict[str, str]) -> tuple[int, bytes]:
    """A SigV4-signed request on `location` (``s3://bucket[/key]``) with `query` and no body: (status, body).
    For the bucket operations obstore has no call for (listing and aborting multipart uploads)."""
    import hmac
    import http.client
    import urllib.parse

    cfg, client_opts, _retry = _config()
    bucket, key = parse_uri(location)
    region = cfg.get("region", "us-east-1")
    endpoint = cfg.get("endpoint") or f"https://s3.{region}.amazonaws.com"
    parts = urllib.parse.urlsplit(endpoint)
    host = parts.netloc
    path = "/" + bucket + ("/" + urllib.parse.quote(key, safe="/~") if key else "")
    canon_query = "&".join(f"{urllib.parse.quote(k, safe='~')}={urllib.parse.quote(v, safe='~')}"
                           for k, v in sorted(query.items()))
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(b"").hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz_date}
    if cfg.get("session_token"):
        headers["x-amz-security-token"] = cfg["session_token"]
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, path, canon_query, "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
                           signed, payload])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    k = ("AWS4" + cfg["secret_access_key"]).encode()
    for part in (day, region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={cfg['access_key_id']}/{scope}, "
                                f"SignedHeaders={signed}, Signature={sig}")
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        conn = conn_cls(host, timeout=30)
        conn.request(method, path + ("?" + canon_query if canon_query else ""), headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
    except OSError:
        raise StoreUnreachableError(f"{location}: endpoint unreachable ({endpoint})") from None
    if resp.status == 404 and b"NoSuchBucket" in body:
        raise StoreNotFoundError(f"s3://{bucket}: no such bucket")
    if resp.status in (401, 403):
        raise StoreAccessDeniedError(f"{location}: access denied (check the credentials and the bucket's policy)")
    return resp.status, body


def incomplete_uploads(prefix: Location) -> list[tuple[str, str]]:
    """Multipart uploads begun and never completed or aborted under `prefix`: [(object URI, upload id)]."""
    import xml.etree.ElementTree as ET

    bucket, key = parse_uri(prefix)
    status, body = signed_request("GET", f"s3://{bucket}", {"uploads": "", "prefix": key + "/" if key else ""})
    if status != 200:
        raise StoreError(f"{prefix}: listing multipart uploads failed (HTTP {status})")
    out = []
    for up in ET.fromstring(body).iter():
        if up.tag.rsplit("}", 1)[-1] != "Upload":
            continue
        fields = {c.tag.rsplit("}", 1)[-1]: (c.text or "") for c in up}
        if fields.get("Key", "").startswith(key + "/" if key else ""):
            out.append((f"s3://{bucket}/{fields['Key']}", fields.get("UploadId", "")))
    return sorted(out)


def abort_upload(location: Location, upload_id: str) -> None:
    """Abort the multipart upload `upload_id` of `location` (its parts are freed)."""
    status, _body = signed_request("DELETE", location, {"uploadId": upload_id})
    if status not in (200, 204, 404):
        raise StoreError(f"{location}: aborting multipart upload failed (HTTP {status})")
