"""PEFT LoRA adapters: ΔW = transpose?(B @ A) · s in float32 per module (docs/SEMANTICS.md, "Expert sources").

s = α/r (α/√r with ``use_rslora``, per-module ``rank_pattern``/``alpha_pattern`` matched like PEFT), transposed
for ``fan_in_fan_out`` and embeddings; ``modules_to_save`` weights are full replacement tensors (Δ = θ − θ₀ like
a full checkpoint).

A LoRA tensor is catalogued under the base tensor's name with virtual row blocks that follow the base's
blocking: block b costs exactly the bytes of the factor rows/columns it needs (rows of B; for transposed
modules the columns of A), and the factor every block needs (A; B when transposed) is its own unit,
block ``FACTOR_BLOCK`` (-2), whose score is the max score of the tensor's blocks, so the ranking puts it
just before them and a selected block always has its factor (realized bytes == planned bytes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES, DTYPE_BITS
from mergepipe_db.core.geometry import block_byte_range, block_ranges, row_count
from mergepipe_db.core.plan import CheckpointInfo, Read, TensorInfo
from mergepipe_db.errors import IntegrityError, LoraAdapterError, PlanExecutionMismatchError
from mergepipe_db.sources.base import DELTA, THETA, ExpertSource, SourceRead, tensor_from_bytes

FACTOR_BLOCK = -2
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {  # key suffix -> (factor letter, is embedding)
    ".lora_A.weight": ("a", False),
    ".lora_B.weight": ("b", False),
    ".lora_embedding_A": ("a", True),
    ".lora_embedding_B": ("b", True),
}


class LoraSource(ExpertSource):
    """A PEFT LoRA adapter of a base (a directory with adapter_config.json and adapter_model.safetensors); read
    as Δ (float32) for its LoRA modules, as θ bytes for its modules_to_save weights."""

    kind: ClassVar[str] = "lora"
    noun: ClassVar[str] = "lora checkpoint"
    scans_itself: ClassVar[bool] = True
    ranked_by_block: ClassVar[bool] = False  # a factor unit (block -2) precedes its blocks
    ties_prunable: ClassVar[bool] = False  # the factor unit and ΔW's rounding make no such promise
    needs_torch: ClassVar[bool] = True
    plain_blocks: ClassVar[bool] = False
    adjusts_reads: ClassVar[bool] = True

    def __init__(self, info: CheckpointInfo) -> None:
        super().__init__(info)
        self.lora: dict[str, dict[str, Any]] = (info.config or {}).get("lora", {})

    @classmethod
    def detect(cls, path: str | Path) -> bool:
        from mergepipe_db.io import as_path, is_remote, open_store

        if is_remote(path):  # a prefix holding adapter_config.json
            q = as_path(path)
            try:
                open_store(q).stat(q / ADAPTER_CONFIG)
            except FileNotFoundError:
                return False
            return True
        p = Path(path)
        return p.is_dir() and (p / ADAPTER_CONFIG).is_file()

    @classmethod
    def open_layout(cls, path: str | Path) -> Any:
        return lora_layout(path)

    @classmethod
    def check_coordinates(cls, layout: Any, base: dict[str, Any], *, what: str) -> None:
        """Validates the adapter against the base (LoraAdapterError) and fills ``layout.config["lora"]``."""
        _validate_lora(layout, base, what=what)

    @classmethod
    def scan(cls, layout: Any, *, block_bytes: int, base: dict[str, Any], progress: bool = False
             ) -> tuple[list[dict], list[dict], list[dict], list[str], int]:
        return scan_lora(layout, block_bytes=block_bytes, base=base, progress=progress)

    def planned(self, et: TensorInfo, reads: tuple[Read, ...]) -> tuple[Read, ...]:
        """A tensor-level LoRA selection (every block, no factor unit: a replayed plan) is the whole-tensor read."""
        if not reads or et.name not in self.lora:
            return reads
        idxs = {r.block_idx for r in reads}
        if FACTOR_BLOCK not in idxs and -1 not in idxs and idxs == set(range(et.n_blocks)):
            return (Read(-1, et.offset, et.nbytes, et.xxh3),)
        return reads

    def read(self, t: TensorInfo, et: TensorInfo, reads: tuple[Read, ...], base: np.ndarray, reader: Any,
             verify: bool, pool: Any) -> SourceRead:
        """ΔW of a LoRA module (float32, 0 on the rows not selected); a modules_to_save weight's θ bytes."""
        from mergepipe_db.sources.selection import read_selected, selected_rows

        if t.name in self.lora:
            return self._read_lora(t, et, reads, reader, verify)
        buf, n_read = read_selected(reader, et, reads, self.info.name, verify)
        blocks, rows = selected_rows(et, reads)
        return SourceRead(THETA, buf, rows, blocks, n_read)

    def _read_lora(self, t: TensorInfo, et: TensorInfo, reads: tuple[Read, ...], reader: Any,
                   verify: bool) -> SourceRead:
        import torch

        from mergepipe_db.sources.selection import selected_rows

        name = self.info.name
        entry = self.lora[t.name]
        idxs = {r.block_idx for r in reads}
        ranges = block_ranges(t.shape, et.rows_per_block)
        whole = -1 in idxs
        blocks = list(range(len(ranges))) if whole else sorted(b for b in idxs if b >= 0)
        if blocks and not (whole or FACTOR_BLOCK in idxs):
            raise PlanExecutionMismatchError(f"plan selects LoRA blocks of {t.name!r} in expert "
                                             f"{name!r} without their shared factor")
        by_idx = {r.block_idx: r for r in reads}
        n_read = 0
        fname = _factor_name(entry)
        factor = None
        if whole or FACTOR_BLOCK in idxs:
            off, n, shape = entry[fname]
            raw = reader.read(et.path, off, n)
            n_read += n
            if verify and FACTOR_BLOCK in by_idx:
                _check_hash(raw, by_idx[FACTOR_BLOCK].xxh3, f"LoRA factor of {t.name!r} ({name!r})")
            factor = tensor_from_bytes(raw, entry["dtype"], shape)
        delta = torch.zeros(t.shape, dtype=torch.float32)
        if whole:  # tensor-level plan: the sliced factor is read whole, once
            other = "a" if fname == "b" else "b"
            off, n, shape = entry[other]
            whole_other = tensor_from_bytes(reader.read(et.path, off, n), entry["dtype"], shape)
            n_read += n
        for bi in blocks:
            r0, r1 = ranges[bi]
            if whole:
                part = whole_other[:, r0:r1] if entry["transposed"] else whole_other[r0:r1]
            else:
                chunk = bytearray()
                for off, n in _lora_pieces(entry, (r0, r1)):
                    chunk += reader.read(et.path, off, n)
                    n_read += n
                if verify:
                    _check_hash(chunk, by_idx[bi].xxh3, f"LoRA block {bi} of {t.name!r} ({name!r})")
                part = _slice_tensor(chunk, entry, (r0, r1))
            if entry["transposed"]:
                delta[r0:r1] = delta_rows(part, factor, entry["scale"], True)
            else:
                delta[r0:r1] = delta_rows(factor, part, entry["scale"], False)
        sel_blocks, rows = selected_rows(et, tuple(r for r in reads if r.block_idx >= -1))
        return SourceRead(DELTA, delta.numpy(), rows, tuple(blocks) if whole else sel_blocks, n_read)

    def delta_tensor(self, t: TensorInfo, et: TensorInfo, reader: Any) -> Any:
        if t.name not in self.lora:
            return super().delta_tensor(t, et, reader)
        e = self.lora[t.name]
        a = tensor_from_bytes(reader.read(et.path, e["a"][0], e["a"][1]), e["dtype"], e["a"][2])
        b = tensor_from_bytes(reader.read(et.path, e["b"][0], e["b"][1]), e["dtype"], e["b"][2])
        return delta_rows(a, b, e["scale"], e["transposed"])


# --------------------------------------------------------------------------------------------------
# Layout and validation
# --------------------------------------------------------------------------------------------------

def lora_layout(path: str | Path) -> Any:
    """A CheckpointLayout for a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

    ``config`` holds ``{"adapter_config": ..., "lora": {}}``; `check_coordinates` fills ``lora``.
    LoraAdapterError when a file is missing or the config is not a LoRA config.
    """
    from mergepipe_db.io import is_remote

    if is_remote(path):
        return _remote_lora_layout(path)
    root = Path(path)
    if not root.is_dir():
        raise LoraAdapterError(f"{root}: a LoRA adapter is a directory with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    cfg_path = root / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise LoraAdapterError(f"{root}: missing {ADAPTER_CONFIG} (not a PEFT LoRA adapter directory)")
    weights = root / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (root / "adapter_model.bin").exists():
            raise LoraAdapterError(f"{root}: adapter_model.bin is a pickle file and is refused; save the adapter "
                                   f"with safe_serialization=True")
        raise LoraAdapterError(f"{root}: missing {ADAPTER_WEIGHTS}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LoraAdapterError(f"{cfg_path}: not valid JSON ({e})") from e
    return _lora_layout(root, cfg_path, weights, cfg)


def _remote_lora_layout(path: str | Path) -> Any:
    """`lora_layout` of an adapter stored under an object-store prefix."""
    from mergepipe_db.io import as_path, open_store

    root = as_path(path)
    store = open_store(root)
    cfg_path, weights = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    try:
        raw = store.read_small(cfg_path, 64 << 20)
    except FileNotFoundError:
        raise LoraAdapterError(f"{root}: missing {ADAPTER_CONFIG} (not a PEFT LoRA adapter prefix)") from None
    if not store.exists(weights):  # type: ignore[attr-defined]
        raise LoraAdapterError(f"{root}: missing {ADAPTER_WEIGHTS}")
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise LoraAdapterError(f"{cfg_path}: not valid JSON ({e})") from e
    return _lora_layout(root, cfg_path, weights, cfg)


def _lora_layout(root: Any, cfg_path: Any, weights: Any, cfg: Any) -> Any:
    from mergepipe_db.formats.hf_layout import CheckpointLayout
    from mergepipe_db.formats.safetensors import read_header

    if not isinstance(cfg, dict):
        raise LoraAdapterError(f"{cfg_path}: not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraAdapterError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise LoraAdapterError(f"{cfg_path}: DoRA adapters (use_dora) are not supported")
    if cfg.get("lora_bias"):
        raise LoraAdapterError(f"{cfg_path}: adapters with a LoRA bias (lora_bias) are not supported")
    header = read_header(weights)
    return CheckpointLayout(root=root, files=(header,), tensor_file=dict.fromkeys(header.by_name(), 0),
                            side_files=(cfg_path,), config={"adapter_config": cfg, "lora": {}})


def _pattern_key(patterns: dict[str, Any], module: str, where: str) -> str:
    """PEFT's `get_pattern_key`: the first pattern key k with re.match(rf"(.*\\.)?({k})$", module)."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error as e:
            raise LoraAdapterError(f"{where}: bad pattern {key!r} in rank_pattern/alpha_pattern: {e}") from e
    return module


def lora_scale(cfg: dict[str, Any], module: str, where: str = ADAPTER_CONFIG) -> tuple[int, float]:
    """(r, s) of `module` as PEFT computes them: rank_pattern/alpha_pattern, α/r or α/√r (use_rslora)."""
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise LoraAdapterError(f"{where}: rank_pattern and alpha_pattern must be objects")
    r = rank_pattern.get(_pattern_key(rank_pattern, module, where), cfg.get("r", 8))
    alpha = alpha_pattern.get(_pattern_key(alpha_pattern, module, where), cfg.get("lora_alpha", 8))
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoraAdapterError(f"{where}: rank r of {module!r} must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{where}: lora_alpha of {module!r} must be a finite number, got {alpha!r}")
    s = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(s)


def _validate_lora(layout: Any, base: dict[str, Any], *, what: str) -> None:
    cfg = layout.config["adapter_config"]
    header = layout.files[0]
    where = f"LoRA adapter {what}"
    fif = bool(cfg.get("fan_in_fan_out", False))
    factors: dict[str, dict[str, Any]] = {}
    full: list[str] = []
    same: list[tuple[str, str]] = []  # copies of base weights PEFT saves beside embedding factors
    for entry in header.tensors:
        key = entry.name
        if not key.startswith(_PREFIX):
            raise LoraAdapterError(f"{where}: unknown key {key!r} (PEFT keys start with {_PREFIX!r})")
        rest = key[len(_PREFIX):]
        for suffix, (letter, emb) in _SUFFIXES.items():
            if rest.endswith(suffix):
                module = rest[: -len(suffix)]
                slot = factors.setdefault(module, {"embedding": emb})
                if slot["embedding"] != emb:
                    raise LoraAdapterError(f"{where}: module {module!r} mixes linear and embedding LoRA factors")
                slot[letter] = entry
                break
        else:
            if rest.endswith(".base_layer.weight") and rest[: -len(".base_layer.weight")] + ".weight" in base:
                same.append((key, rest[: -len(".base_layer.weight")] + ".weight"))  # save_embedding_layers
            elif rest in base:
                full.append(rest)  # a modules_to_save weight: a full replacement tensor
            else:
                raise LoraAdapterError(f"{where}: key {key!r} names no LoRA factor and no base tensor "
                                       f"(unknown module)")
    if not factors and not full:
        raise LoraAdapterError(f"{where}: the adapter holds no LoRA factors")
    lora: dict[str, dict[str, Any]] = {}
    for module, slot in sorted(factors.items()):
        tname = f"{module}.weight"
        if "a" not in slot or "b" not in slot:
            raise LoraAdapterError(f"{where}: module {module!r} lacks its lora_{'B' if 'a' in slot else 'A'} factor")
        bt = base.get(tname)
        if bt is None:
            raise LoraAdapterError(f"{where}: unknown module {module!r}: the base has no tensor {tname!r}")
        a, b = slot["a"], slot["b"]
        r, s = lora_scale(cfg, module, where)
        emb = slot["embedding"]
        transposed = emb or fif
        if len(bt.shape) != 2:
            raise LoraAdapterError(f"{where}: {tname!r} has shape {list(bt.shape)}; LoRA needs a 2-d weight")
        if a.dtype != b.dtype or a.dtype not in ARITHMETIC_DTYPES or bt.dtype not in ARITHMETIC_DTYPES:
            raise LoraAdapterError(f"{where}: {module!r} factors have dtypes {a.dtype}/{b.dtype} (base "
                                   f"{bt.dtype}); need one arithmetic dtype")
        rows, cols = bt.shape  # ΔW's shape = the base weight's
        out_dim, in_dim = (cols, rows) if transposed else (rows, cols)
        want_a, want_b = (r, in_dim), (out_dim, r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoraAdapterError(
                f"{where}: {module!r} shapes A {list(a.shape)} B {list(b.shape)} do not fit r={r} and base "
                f"{tname!r} {list(bt.shape)} (want A {list(want_a)}, B {list(want_b)})")
        lora[tname] = {
            "module": module, "r": r, "scale": s, "transposed": transposed, "embedding": emb, "dtype": a.dtype,
            "a": [header.absolute_offset(a), a.nbytes, list(a.shape)],
            "b": [header.absolute_offset(b), b.nbytes, list(b.shape)],
        }
    for tname in full:
        entry = header.by_name()[_PREFIX + tname]
        bt = base[tname]
        if tname in lora:
            raise LoraAdapterError(f"{where}: {tname!r} is both a LoRA module and a modules_to_save weight")
        if tuple(entry.shape) != bt.shape or entry.dtype != bt.dtype:
            raise LoraAdapterError(f"{where}: modules_to_save weight {tname!r} is {entry.dtype} "
                                   f"{list(entry.shape)}, base {bt.dtype} {list(bt.shape)}")
    for key, tname in same:
        entry, bt = header.by_name()[key], base[tname]
        if tuple(entry.shape) != bt.shape or entry.dtype != bt.dtype:
            raise LoraAdapterError(f"{where}: saved base layer {key!r} is {entry.dtype} {list(entry.shape)}, base "
                                   f"{bt.dtype} {list(bt.shape)} (resized vocabulary is not supported)")
    layout.config["lora"] = lora
    layout.config["full"] = sorted(full)
    layout.config["same_as_base"] = sorted(same)


# LoRA math
# --------------------------------------------------------------------------------------------------


def delta_rows(a_part: Any, b_part: Any, scale: float, transposed: bool) -> Any:
    """Rows of ΔW in float32, PEFT's formula on factor slices: transpose?(B @ A) · s.

    Non-transposed: ``b_part`` = rows of B, ``a_part`` = A. Transposed (fan_in_fan_out, embeddings):
    ``b_part`` = B, ``a_part`` = the columns of A for those rows."""
    import torch

    d = torch.matmul(b_part.to(torch.float32), a_part.to(torch.float32))
    if transposed:
        d = d.T
    return (d * scale).contiguous()


def _lora_pieces(entry: dict[str, Any], rows: tuple[int, int]) -> list[tuple[int, int]]:
    """The (absolute offset, nbytes) ranges of the sliced factor that rows [r0, r1) of ΔW need."""
    isz = DTYPE_BITS[entry["dtype"]] // 8
    r0, r1 = rows
    if entry["transposed"]:
        off, _n, (r, n_in) = entry["a"]
        return [(off + (j * n_in + r0) * isz, (r1 - r0) * isz) for j in range(r)]
    off, _n, (_out, r) = entry["b"]
    return [(off + r0 * r * isz, (r1 - r0) * r * isz)]


def _factor_name(entry: dict[str, Any]) -> str:
    return "b" if entry["transposed"] else "a"


def _slice_tensor(buf: bytes | bytearray, entry: dict[str, Any], rows: tuple[int, int]) -> Any:
    """The sliced factor's part for rows [r0, r1) from the concatenated bytes of its pieces."""
    import torch

    from mergepipe_db.core.dtypes import torch_dtype

    t = torch.frombuffer(bytearray(buf), dtype=torch_dtype(entry["dtype"])) if len(buf) else torch.empty(
        0, dtype=torch_dtype(entry["dtype"]))
    n = rows[1] - rows[0]
    if entry["transposed"]:
        return t.reshape(entry["a"][2][0], n)
    return t.reshape(n, entry["b"][2][1])


def scan_lora(layout: Any, *, block_bytes: int, base: dict[str, Any], progress: bool = False,
              delta: bool = False) -> tuple[list[dict], list[dict], list[dict], list[str], int]:
    """Ingest scan of a LoRA adapter: (file rows, tensor rows, block rows, sha256s, bytes read).

    The adapter file is read once; ΔW is formed one base row block at a time (never whole on disk or in
    memory beyond a block); modules_to_save weights are compared with the base block by block."""
    import xxhash

    from mergepipe_db.core.hashing import xxh3_hex
    from mergepipe_db.io import open_store
    from mergepipe_db.kernels.block_stats import delta_block_stats, float32_delta_block_stats, zero_block_stats

    del block_bytes, progress, delta
    header = layout.files[0]
    with open_store(header.path).open_input(header.path) as f:
        data = f.read(0, f.size)
    sha = hashlib.sha256(data).hexdigest()
    lora: dict[str, dict[str, Any]] = layout.config["lora"]
    full = set(layout.config.get("full", []))
    tensor_rows: list[dict] = []
    block_rows: list[dict] = []
    by_name = header.by_name()
    for key, tname in layout.config.get("same_as_base", []):
        entry, bt = by_name[key], base[tname]
        off0 = header.absolute_offset(entry)
        for bi, rows in enumerate(block_ranges(bt.shape, bt.rows_per_block)):
            rel, length = block_byte_range(entry.shape, DTYPE_BITS[entry.dtype], rows)
            if bi >= len(bt.block_xxh3) or xxh3_hex(data[off0 + rel:off0 + rel + length]) != bt.block_xxh3[bi]:
                raise LoraAdapterError(f"LoRA adapter {layout.root}: saved base layer {key!r} differs from the base's "
                                       f"{tname!r}; an adapter that also replaces the base weight is not supported")
    base_reader = open_store(next(iter(base.values())).path).range_reader(random=False)  # the base's store
    try:
        for bt in sorted(base.values(), key=lambda x: x.idx):
            if bt.name not in lora and bt.name not in full:
                continue
            tidx = len(tensor_rows)
            ranges = block_ranges(bt.shape, bt.rows_per_block)
            if bt.name in full:
                entry = by_name[_PREFIX + bt.name]
                off0 = header.absolute_offset(entry)
                tx = xxhash.xxh3_128()
                l2sq, all_equal = 0.0, True
                for bi, rows in enumerate(ranges):
                    rel, length = block_byte_range(entry.shape, DTYPE_BITS[entry.dtype], rows)
                    chunk = data[off0 + rel: off0 + rel + length]
                    tx.update(chunk)
                    h = xxh3_hex(chunk)
                    same = bi < len(bt.block_xxh3) and bt.block_xxh3[bi] == h
                    stats = zero_block_stats(length, entry.dtype) if same else delta_block_stats(
                        bytearray(chunk), base_reader.read(bt.path, bt.offset + rel, length), entry.dtype)
                    l2sq += stats["delta_l2"] ** 2
                    all_equal &= stats["delta_max"] == 0.0 and same
                    block_rows.append({"tensor_idx": tidx, "block_idx": bi, "row_start": rows[0], "row_stop": rows[1],
                                       "offset": off0 + rel, "nbytes": length, "xxh3": h, **stats})
                tensor_rows.append({
                    "tensor_idx": tidx, "name": bt.name, "dtype": entry.dtype, "shape": json.dumps(list(entry.shape)),
                    "file_idx": 0, "offset": off0, "nbytes": entry.nbytes, "n_rows": row_count(entry.shape),
                    "rows_per_block": bt.rows_per_block, "n_blocks": len(ranges), "xxh3": tx.hexdigest(),
                    "delta_l2": l2sq ** 0.5, "equal_to_base": all_equal})
                continue
            e = lora[bt.name]
            a_off, a_n, a_shape = e["a"]
            b_off, b_n, b_shape = e["b"]
            a = tensor_from_bytes(data[a_off:a_off + a_n], e["dtype"], a_shape)
            b = tensor_from_bytes(data[b_off:b_off + b_n], e["dtype"], b_shape)
            l2sq, best = 0.0, 0.0
            for bi, rows in enumerate(ranges):
                pieces = _lora_pieces(e, rows)
                chunk = b"".join(data[o:o + n] for o, n in pieces)
                r0, r1 = rows
                d = delta_rows(a[:, r0:r1], b, e["scale"], True) if e["transposed"] else delta_rows(
                    a, b[r0:r1], e["scale"], False)
                stats = float32_delta_block_stats(d)
                l2sq += stats["delta_l2"] ** 2
                best = max(best, stats["delta_l2"])
                block_rows.append({"tensor_idx": tidx, "block_idx": bi, "row_start": r0, "row_stop": r1,
                                   "offset": pieces[0][0], "nbytes": sum(n for _o, n in pieces),
                                   "xxh3": xxh3_hex(chunk), **stats})
            f_off, f_n, _shape = e[_factor_name(e)]
            block_rows.append({"tensor_idx": tidx, "block_idx": FACTOR_BLOCK, "row_start": 0, "row_stop": 0,
                               "offset": f_off, "nbytes": f_n, "xxh3": xxh3_hex(data[f_off:f_off + f_n]),
                               "delta_l2": best, "delta_l1": None, "delta_max": None, "pos_frac": None,
                               "sketch": None})
            tx = xxhash.xxh3_128()
            tx.update(data[a_off:a_off + a_n])
            tx.update(data[b_off:b_off + b_n])
            tx.update(json.dumps([e["scale"], e["transposed"]]).encode())  # the scaling is content too
            tensor_rows.append({
                "tensor_idx": tidx, "name": bt.name, "dtype": e["dtype"], "shape": json.dumps(list(bt.shape)),
                "file_idx": 0, "offset": min(a_off, b_off), "nbytes": a_n + b_n, "n_rows": row_count(bt.shape),
                "rows_per_block": bt.rows_per_block, "n_blocks": len(ranges), "xxh3": tx.hexdigest(),
                "delta_l2": l2sq ** 0.5, "equal_to_base": l2sq == 0.0})
    finally:
        base_reader.close()
    from mergepipe_db.io import is_remote, open_store

    store = open_store(header.path)
    st = store.stat(header.path)
    rel = (str(header.path)[len(str(layout.root)) + 1:] if is_remote(header.path)
           else os.path.relpath(header.path, layout.root))
    file_rows = [{"file_idx": 0, "relpath": rel,
                  "path": store.absolute(header.path), "size": st.size, "mtime_ns": int(st.version),
                  "sha256": sha, "header_len": header.header_len}]
    return file_rows, tensor_rows, block_rows, [sha], len(data)


def _check_hash(data: Any, expected: str, what: str) -> None:
    from mergepipe_db.core.hashing import xxh3_hex

    got = xxh3_hex(data)
    if got != expected:
        raise IntegrityError(f"corrupted read in {what}: xxh3 {got} != catalog {expected}")


