"""Shared helpers: cold-cache discipline, measured subprocesses, statistics, families, tables.

Every timed job runs as its own subprocess after `sync; echo 3 > /proc/sys/vm/drop_caches`. The parent waits
for it with `waitid(WNOWAIT)` so the child is still a zombie when its `/proc/PID/io` (read_bytes,
write_bytes) is read, then reaps it with `wait4`. Peak RSS is the child's own VmHWM, sampled while it runs
(wait4's ru_maxrss would carry over the harness's own peak: see `_vm_hwm`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
DATA = Path(os.environ.get("MERGEPIPE_BENCH_DATA", "/work/bench-data"))
RESULTS = REPO / "benchmarks" / "results"
FIGURES = REPO / "benchmarks" / "figures"
RAW = RESULTS / "raw"
GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Config:
    quick: bool
    model_bytes: int
    n_experts: int
    reps: int
    shard_bytes: int

    @property
    def family_dir(self) -> Path:
        tag = "quick" if self.quick else f"{self.model_bytes / 1e9:g}g"
        return DATA / f"fam-{tag}"

    @property
    def catalog(self) -> Path:
        return self.family_dir / "catalog.duckdb"


def config(quick: bool) -> Config:
    if quick:
        return Config(True, int(os.environ.get("BENCH_MODEL_BYTES", 20e6)), 16, 3, 8 * MiB)
    return Config(False, int(float(os.environ.get("BENCH_MODEL_BYTES", 1e9))), 16,
                  int(os.environ.get("BENCH_REPS", 3)), 512 * MiB)


# --- cold cache and measured subprocesses -------------------------------------------------------------

_warned = False


def drop_caches() -> bool:
    global _warned
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        if not _warned:
            print(f"[bench] WARNING: cannot drop caches ({e}); timings are warm-cache", file=sys.stderr)
            _warned = True
        return False


def _proc_io(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                k, v = line.split(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


@dataclass
class Measured:
    cmd: list[str]
    wall: float
    read_bytes: int
    write_bytes: int
    rchar: int
    maxrss: int  # bytes: the peak RSS of the process itself (VmHWM, sampled every 10 ms)
    rc: int
    cold: bool
    stdout: str = ""
    stderr: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["stderr"] = d["stderr"][-2000:]
        d["stdout"] = d["stdout"][-4000:]
        return d


def _vm_hwm(pid: int) -> int:
    """The process's own peak RSS so far (VmHWM, bytes), 0 once it is gone. Not wait4's ru_maxrss: Linux
    starts a child's maxrss at its parent's peak (carried over at exec), so once this harness has grown (it
    loads outputs to compare them) every child would report at least the harness's size."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(cmd: list[str], *, cold: bool = True, env: dict[str, str] | None = None, cwd: Path | None = None,
            check: bool = True, timeout: float = 3600) -> Measured:
    """Run `cmd` once (after dropping caches when `cold`) and measure wall, /proc io and peak RSS."""
    was_cold = drop_caches() if cold else False
    full_env = dict(os.environ)
    full_env.update(env or {})
    out_f = open(DATA / ".stdout", "w+")  # noqa: SIM115 - handed to the child process, closed below
    err_f = open(DATA / ".stderr", "w+")  # noqa: SIM115
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env=full_env, cwd=cwd or REPO)
    deadline = t0 + timeout
    hwm = 0
    while True:
        info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        if info is not None:
            break
        hwm = max(hwm, _vm_hwm(p.pid))
        if time.perf_counter() > deadline:
            p.kill()
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    io = _proc_io(p.pid)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    out_f.seek(0)
    err_f.seek(0)
    m = Measured(cmd=[str(c) for c in cmd], wall=wall, read_bytes=io.get("read_bytes", -1),
                 write_bytes=io.get("write_bytes", -1), rchar=io.get("rchar", -1), maxrss=hwm or ru.ru_maxrss * 1024,
                 rc=p.returncode, cold=was_cold, stdout=out_f.read(), stderr=err_f.read())
    out_f.close()
    err_f.close()
    if check and m.rc != 0:
        raise RuntimeError(f"command failed (rc={m.rc}): {' '.join(m.cmd)}\n{m.stderr[-3000:]}")
    return m


# --- statistics ---------------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    """'median [min–max]'."""
    return f"{min(xs):.2f}–{max(xs):.2f}"


def fmt_t(xs: list[float]) -> str:
    return f"{med(xs):.2f} s [{spread(xs)}]"


def gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines) + "\n"


def save_raw(name: str, obj: Any) -> None:
    RAW.mkdir(parents=True, exist_ok=True)
    (RAW / f"{name}.json").write_text(json.dumps(obj, indent=1, default=str))


def write_section(name: str, text: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)


def rmtree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)


def dir_files(d: Path) -> list[Path]:
    return sorted(p for p in Path(d).glob("*.safetensors"))


def family_note(cfg: Config) -> str:
    """One sentence naming the family a section was measured on (sections from different runs may differ)."""
    import json

    fam = json.loads((cfg.family_dir / "family.json").read_text())
    shape = fam["shape"]
    return (f"Family: {fam['model_bytes'] / 1e9:.2f} GB per model (Llama-shaped BF16, {shape['num_layers']} layers, "
            f"hidden {shape['hidden_size']}, {fam['shard_bytes'] >> 20} MiB shards).")


def machine_line() -> str:
    import platform

    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    return f"{os.cpu_count()} cores, {mem / 2**30:.0f} GiB RAM, {platform.platform()}"
