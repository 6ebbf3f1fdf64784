"""Synthetic Llama-shaped checkpoint families for tests, `mergepipe demo` and benchmarks.

`make_family(root)` writes one base model and `n_experts` fine-tuned experts, each a Hugging Face model
directory that `transformers` loads. Everything is a pure function of the arguments: the same call writes
byte-identical files, with no downloads. Every tensor is drawn from its own generator keyed by
(seed, model, tensor name), so values do not depend on sharding, on the number of experts or on the order
in which tensors are made.

The expert deltas imitate real fine-tunes, because the planner ranks blocks by delta norm:

* each expert strongly touches a few tensors (its own layers: ``layer % period == k % period``, and mainly
  either the MLP or the attention projections; sometimes token rows of the embeddings);
* inside a touched matrix the change sits in one dominant contiguous row band (2-8 % of the rows) and up
  to two weaker ones, with heavy-tailed (Student-t, 3 dof) row scales over a faint background, so row
  blocks differ strongly in delta norm;
* about a third of the other tensors are left exactly equal to the base (identical bytes), the rest get
  a tiny noise that mostly rounds away in BF16;
* a touched tensor changes by ``||Δ|| = delta_scale · f · ||W||``, f a per-tensor log-normal factor
  (times 1 for the expert's focus group, 0.5 for embeddings and norms, 0.25 for other matrices).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "PRESETS",
    "Family",
    "LlamaShape",
    "make_demo_spec",
    "make_family",
    "shape_for_bytes",
    "write_model_dir",
]

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
MAX_POSITION_EMBEDDINGS = 128

_DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}

_INIT_STD = 0.02  # std of base matrix weights
_NORM_STD = 0.02  # std of base norm weights around 1.0
_NOISE_REL = 0.02  # untouched-but-noisy tensors: ||Δ|| = _NOISE_REL * delta_scale * ||W||
_BACKGROUND = 0.01  # row scale outside the bands of a touched matrix (the main band's rms is 1)


def canonical_dtype(dtype: str) -> str:
    """The canonical name ("bfloat16", "float16", "float32") of a dtype string; ValueError if unknown."""
    try:
        return _DTYPE_ALIASES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}: use one of bfloat16, float16, float32") from None


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        canonical_dtype(dtype)
    ]


# --- shapes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama decoder (what `LlamaConfig` needs to know about tensor shapes)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"LlamaShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.vocab_size <= max(BOS_TOKEN_ID, EOS_TOKEN_ID):
            raise ValueError(f"vocab_size must be > {max(BOS_TOKEN_ID, EOS_TOKEN_ID)}, got {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every stored tensor, Hugging Face Llama names in Hugging Face order."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab_size, h))]
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            specs += [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        specs.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            specs.append(("lm_head.weight", (self.vocab_size, h)))
        return specs

    def num_params(self) -> int:
        """Number of stored parameters (elements); a tied lm_head is not counted twice."""
        return sum(math.prod(shape) for _, shape in self.tensor_specs())

    def nbytes(self, dtype: str = "bfloat16") -> int:
        """Bytes of tensor data of one model in `dtype` (safetensors headers excluded)."""
        return self.num_params() * _ITEMSIZE[canonical_dtype(dtype)]

    def config_dict(self, dtype: str) -> dict[str, Any]:
        """A `config.json` for `LlamaForCausalLM` (transformers 4.x and 5.x) with this shape."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
            "initializer_range": _INIT_STD,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "use_cache": True,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "torch_dtype": canonical_dtype(dtype),
        }


PRESETS: dict[str, LlamaShape] = {
    # ~92 K parameters: ~180 KB per model in BF16.
    "tiny": LlamaShape(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    ),
    # ~7.3 M parameters: ~14.7 MB per model in BF16.
    "small": LlamaShape(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=6, num_heads=8, num_kv_heads=4
    ),
    # TinyLlama-like at 14 layers: ~762 M parameters, ~1.52 GB per model in BF16.
    "bench": LlamaShape(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=14,
        num_heads=16,
        num_kv_heads=4,
    ),
}

# (hidden, heads, kv heads, vocab) in increasing size; shape_for_bytes picks a rung and a layer count.
_LADDER: tuple[tuple[int, int, int, int], ...] = (
    (64, 4, 2, 128),
    (128, 4, 2, 512),
    (256, 8, 4, 2048),
    (512, 8, 4, 8192),
    (1024, 16, 4, 32000),
    (2048, 16, 4, 32000),
    (3072, 24, 8, 32000),
    (4096, 32, 8, 32000),
    (5120, 40, 8, 32000),
    (8192, 64, 8, 32000),
)
_MAX_LAYERS_PER_RUNG = 32


def shape_for_bytes(target_bytes: int, dtype: str = "bfloat16") -> LlamaShape:
    """A Llama shape whose model is near `target_bytes` of tensor data in `dtype`.

    Takes the narrowest hidden size that reaches the target with at most 32 layers, then the layer count
    that comes closest. Below the smallest one-layer model, that model is returned.
    """
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be > 0, got {target_bytes}")
    target_params = target_bytes / _ITEMSIZE[canonical_dtype(dtype)]
    for n, (hidden, heads, kv_heads, vocab) in enumerate(_LADDER):
        inter = -(-hidden * 11 // 4 // 64) * 64  # 2.75 x hidden, rounded up to a multiple of 64
        one = LlamaShape(vocab, hidden, inter, 1, heads, kv_heads)
        two = LlamaShape(vocab, hidden, inter, 2, heads, kv_heads)
        per_layer = two.num_params() - one.num_params()
        fixed = one.num_params() - per_layer
        layers = max(1, round((target_params - fixed) / per_layer))
        if layers <= _MAX_LAYERS_PER_RUNG or n == len(_LADDER) - 1:
            return LlamaShape(vocab, hidden, inter, layers, heads, kv_heads)
    raise AssertionError("unreachable")


# --- writing model directories --------------------------------------------------------------------

_WEIGHT_FILE = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|\.model-\d{5}\.safetensors\.partial)$")


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_model_dir(
    dest: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    config: dict[str, Any],
    shard_bytes: int | None,
) -> None:
    """Write a Hugging Face model directory from (name, tensor) pairs, consumed lazily in order.

    Tensors are packed in the order given; a new shard starts when the next tensor would take the current
    one past `shard_bytes` (tensor data bytes; a single tensor larger than that gets a shard of its own).
    One shard gives `model.safetensors`, several give `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json`. Only one shard's tensors are held at a time. Also writes `config.json`,
    `generation_config.json` and `tokenizer_config.json`; weight files of an earlier write are removed.
    """
    from safetensors.torch import save_file

    if shard_bytes is not None and shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be > 0 or None, got {shard_bytes}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    stale = [p for p in dest.iterdir() if _WEIGHT_FILE.match(p.name)]
    stale += [dest / "model.safetensors.index.json"]
    for p in stale:
        p.unlink(missing_ok=True)

    parts: list[tuple[Path, list[str]]] = []
    seen: set[str] = set()
    total = 0
    shard: dict[str, torch.Tensor] = {}
    shard_size = 0

    def flush() -> None:
        nonlocal shard, shard_size
        path = dest / f".model-{len(parts) + 1:05d}.safetensors.partial"
        save_file(shard, str(path), metadata={"format": "pt"})
        parts.append((path, list(shard)))
        shard, shard_size = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes is not None and shard_size + nbytes > shard_bytes:
            flush()
        shard[name] = tensor.contiguous()
        shard_size += nbytes
        total += nbytes
    if shard or not parts:
        flush()

    if len(parts) == 1:
        os.replace(parts[0][0], dest / "model.safetensors")
    else:
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(parts, start=1):
            final = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
            os.replace(path, dest / final)
            weight_map.update((n, final) for n in names)
        _write_json(
            dest / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},  # keys sorted, as HF writes
        )
    _write_json(dest / "config.json", config)
    _write_json(
        dest / "generation_config.json",
        {
            "bos_token_id": config.get("bos_token_id", BOS_TOKEN_ID),
            "eos_token_id": config.get("eos_token_id", EOS_TOKEN_ID),
        },
    )
    _write_json(
        dest / "tokenizer_config.json",
        {"model_max_length": config.get("max_position_embeddings", MAX_POSITION_EMBEDDINGS)},
    )


# --- deterministic values -----------------------------------------------------------------------


def _key(seed: int, *parts: object) -> bytes:
    text = "\x1f".join(["mergepipe-testing", str(seed), *map(str, parts)])
    return hashlib.sha256(text.encode("utf-8")).digest()


def _generator(seed: int, *parts: object) -> torch.Generator:
    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(_key(seed, *parts)[:8], "little") & (2**63 - 1))
    return g


def _uniform(seed: int, *parts: object) -> float:
    """A deterministic number in [0, 1) (for the structural choices of an expert)."""
    return int.from_bytes(_key(seed, *parts)[:8], "little") / 2**64


def _base_tensor(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The base value of a tensor, float32: N(0, 0.02) for matrices, 1 + N(0, 0.02) for norm weights."""
    import torch

    g = _generator(seed, "base", name)
    t = torch.randn(shape, generator=g, dtype=torch.float32)
    if len(shape) == 1:
        return t.mul_(_NORM_STD).add_(1.0)
    return t.mul_(_INIT_STD)


@dataclass(frozen=True)
class _Change:
    kind: str  # "zero" | "noise" | "touched"
    factor: float = 1.0  # relative strength of a touched tensor


def _expert_plan(seed: int, expert: int, shape: LlamaShape) -> dict[str, _Change]:
    """What expert `expert` does to each tensor; a pure function of (seed, expert, shape)."""
    period = min(shape.num_layers, 3)
    own_layer = expert % period
    # experts k and k + period share layers but not the focus group; the pattern repeats every 2 * period
    focus = ("mlp", "self_attn")[(expert % period + expert // period) % 2]
    plan: dict[str, _Change] = {}
    for name, dims in shape.tensor_specs():
        u = _uniform(seed, "plan", expert, name)
        m = re.match(r"model\.layers\.(\d+)\.(\w+)\.", name)
        if m is None:  # embeddings, lm_head, final norm
            if len(dims) == 1:
                plan[name] = _Change("touched", 0.5) if u < 0.5 else _Change("noise")
            elif u < 0.3:
                plan[name] = _Change("touched", 0.5)
            else:
                plan[name] = _Change("zero") if u < 0.6 else _Change("noise")
            continue
        layer, group = int(m.group(1)), m.group(2)
        if layer % period == own_layer:
            if group == focus:
                plan[name] = _Change("touched", 1.0)
            elif len(dims) == 1:
                plan[name] = _Change("touched", 0.5)
            else:
                plan[name] = _Change("touched", 0.25) if u < 0.5 else _Change("noise")
        else:
            zero_p = 0.7 if len(dims) == 1 else 0.55
            plan[name] = _Change("zero") if u < zero_p else _Change("noise")
    return plan


def _row_scales(rows: int, g: torch.Generator) -> torch.Tensor:
    """Per-row delta scale of a touched matrix: 1-3 contiguous bands over a faint background.

    The first band (2-8 % of the rows, rms row scale 1) dominates; the others (1-4 %) are 3-10x weaker.
    Inside a band, row scales are |Student-t| with 3 degrees of freedom (heavy-tailed), rescaled to the
    band's rms.
    """
    import torch

    scale = torch.full((rows,), _BACKGROUND, dtype=torch.float32)
    n_bands = 1 + int(torch.randint(0, 3, (1,), generator=g))
    for i in range(n_bands):
        u_width, u_weak = (float(x) for x in torch.rand(2, generator=g))
        frac = 0.02 + 0.06 * u_width if i == 0 else 0.01 + 0.03 * u_width
        width = max(1, round(frac * rows))
        start = int(torch.randint(0, rows - width + 1, (1,), generator=g))
        band = 1.0 if i == 0 else 0.1 + 0.25 * u_weak
        z = torch.randn(width, generator=g)
        chi2 = torch.randn(3, width, generator=g).square_().sum(0)
        t3 = (z / (chi2 / 3).sqrt_()).abs_().clamp_(0.1, 10.0)
        t3.mul_(band / float(t3.square().mean().sqrt()))
        scale[start : start + width] = torch.maximum(scale[start : start + width], t3)
    return scale


def _expert_tensor(
    seed: int,
    expert: int,
    name: str,
    base: torch.Tensor,
    change: _Change,
    delta_scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The expert's stored tensor: the stored base value plus its delta, cast to `dtype`."""
    import torch

    stored = base.to(dtype)
    if change.kind == "zero" or delta_scale == 0:
        return stored
    g = _generator(seed, f"expert_{expert}", name)
    base32 = base.copy_(stored)  # the stored value, upcast in place (one float32 copy fewer)
    w_norm = float(torch.linalg.vector_norm(base32))
    delta = torch.randn(base.shape, generator=g, dtype=torch.float32)
    if change.kind == "noise":
        target = _NOISE_REL * delta_scale * w_norm
    else:
        target = delta_scale * change.factor * math.exp(0.5 * float(torch.randn((), generator=g))) * w_norm
        if delta.dim() >= 2:
            delta.mul_(_row_scales(delta.shape[0], g).view(-1, *([1] * (delta.dim() - 1))))
    d_norm = float(torch.linalg.vector_norm(delta))
    if d_norm > 0:
        delta.mul_(target / d_norm)
    return delta.add_(base32).to(dtype)


# --- families ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A generated base model and its experts (each a Hugging Face model directory)."""

    root: Path
    base: Path
    experts: tuple[Path, ...]
    shape: LlamaShape
    dtype: str


def _resolve_shape(preset: str | LlamaShape) -> LlamaShape:
    if isinstance(preset, LlamaShape):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(
            f"unknown preset {preset!r}: use one of {', '.join(PRESETS)} or a LlamaShape"
        ) from None


def make_family(
    root: str | Path,
    *,
    n_experts: int = 4,
    preset: str | LlamaShape = "tiny",
    dtype: str = "bfloat16",
    seed: int = 0,
    shard_bytes: int | None = None,
    delta_scale: float = 0.02,
    progress: bool = False,
) -> Family:
    """Write `root/base` and `root/expert_00` ... `root/expert_{n-1}`; return where they are.

    Deterministic: the same arguments write byte-identical files. Tensor values do not depend on
    `shard_bytes` or `n_experts` (a family with fewer experts is a prefix of one with more). Models are
    written one after another, one shard in memory at a time (the whole model when unsharded), and at most
    three float32 copies of one tensor; `safetensors.torch.save_file` serializes a copy of the shard, so
    peak memory is about 2 x shard size (unsharded "bench": ~2.9 GB RSS, 512 MiB shards: ~1.6 GB).
    `shard_bytes` counts tensor data bytes per shard; ValueError on bad arguments. `progress` shows a tqdm
    bar (bytes) on stderr.
    """
    from tqdm import tqdm

    shape = _resolve_shape(preset)
    dtype = canonical_dtype(dtype)
    if n_experts < 0:
        raise ValueError(f"n_experts must be >= 0, got {n_experts}")
    if not (delta_scale >= 0 and math.isfinite(delta_scale)):
        raise ValueError(f"delta_scale must be a finite number >= 0, got {delta_scale}")
    tdtype = _torch_dtype(dtype)
    root = Path(root)
    width = max(2, len(str(n_experts - 1)))
    base_dir = root / "base"
    expert_dirs = tuple(root / f"expert_{k:0{width}d}" for k in range(n_experts))
    specs = shape.tensor_specs()
    config = shape.config_dict(dtype)

    bar = tqdm(
        total=shape.nbytes(dtype) * (n_experts + 1),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not progress,
        desc="family",
    )

    def base_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, dims in specs:
            t = _base_tensor(seed, name, dims).to(tdtype)
            bar.update(t.numel() * t.element_size())
            yield name, t

    def expert_tensors(k: int) -> Iterator[tuple[str, torch.Tensor]]:
        plan = _expert_plan(seed, k, shape)
        for name, dims in specs:
            t = _expert_tensor(seed, k, name, _base_tensor(seed, name, dims), plan[name], delta_scale, tdtype)
            bar.update(t.numel() * t.element_size())
            yield name, t

    try:
        bar.set_description("base")
        write_model_dir(base_dir, base_tensors(), config=config, shard_bytes=shard_bytes)
        for k, d in enumerate(expert_dirs):
            bar.set_description(d.name)
            write_model_dir(d, expert_tensors(k), config=config, shard_bytes=shard_bytes)
    finally:
        bar.close()
    return Family(root=root, base=base_dir, experts=expert_dirs, shape=shape, dtype=dtype)


# --- merge specs --------------------------------------------------------------------------------

_MODEL_PARAMS = frozenset({"weight", "density", "gamma", "epsilon"})
_TOP_LEVEL = frozenset({"seed", "dtype", "tokenizer_source", "out", "name"})
_DENSITY_METHODS = frozenset(
    {"ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear"}
)
_NORMALIZE_METHODS = frozenset({"linear", "ties"})


def make_demo_spec(
    family: Family, method: str = "ties", budget: str | float = 0.25, **kw: Any
) -> dict[str, Any]:
    """A MergeKit-style merge spec dict over `family` (base plus every expert, in order).

    Defaults: weight 1/K per expert, density 0.5 for density methods, normalize true for linear/ties,
    seed 0, dtype of the family. Keywords override: ``weight``/``density``/``gamma``/``epsilon`` (a scalar
    for every expert or a sequence, one per expert) go to ``models[].parameters``; ``seed``, ``dtype``,
    ``tokenizer_source``, ``out`` and ``name`` are top-level keys; anything else (``normalize``, ``lambda_``
    for ``lambda``, ``t``, ...) goes to the global ``parameters``. slerp takes the first expert only.
    """
    experts = list(family.experts[:1] if method == "slerp" else family.experts)
    if not experts:
        raise ValueError("the family has no experts to merge")
    n = len(experts)
    model_params: dict[str, Any] = {}
    if method not in ("slerp", "model_stock"):
        model_params["weight"] = 1.0 / n
    if method in _DENSITY_METHODS:
        model_params["density"] = 0.5
    params: dict[str, Any] = {}
    if method in _NORMALIZE_METHODS:
        params["normalize"] = True
    if method == "slerp":
        params["t"] = 0.5
    spec: dict[str, Any] = {"merge_method": method, "base_model": str(family.base)}
    for key, value in kw.items():
        if key in _MODEL_PARAMS:
            model_params[key] = value
        elif key in _TOP_LEVEL:
            spec[key] = value
        else:
            params["lambda" if key == "lambda_" else key] = value

    def per_expert(value: Any, k: int) -> Any:
        if isinstance(value, Sequence) and not isinstance(value, str):
            if len(value) != n:
                raise ValueError(f"expected {n} per-expert values, got {len(value)}")
            return value[k]
        return value

    spec["models"] = [
        {"model": str(path), "parameters": {key: per_expert(v, k) for key, v in model_params.items()}}
        for k, path in enumerate(experts)
    ]
    spec["parameters"] = params
    spec.setdefault("dtype", family.dtype)
    spec.setdefault("seed", 0)
    spec["budget"] = budget
    return spec
