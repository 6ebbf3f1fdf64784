"""Decoder layer naming: which tensors of a checkpoint belong to layer N, and which come before or after the layers.

A MergeKit config names layers by index (`layer_range: [0, 24]`); the tensors are found from the architecture's
naming. The decoder layouts known here (`LAYOUTS`) cover the common Hugging Face causal LMs:

| layout prefix | architectures |
|---|---|
| `model.layers.N.` | Llama, Mistral, Mixtral, Qwen2/3, Gemma, Phi-3, StableLM, Cohere, OLMo, InternLM2 (HF), ... |
| `transformer.h.N.` | GPT-2, GPT-J, Falcon, Qwen (v1), BLOOM, StarCoder |
| `model.decoder.layers.N.` | OPT |
| `gpt_neox.layers.N.` | GPT-NeoX, Pythia |
| `transformer.blocks.N.` | MPT |
| `transformer.layers.N.` | ChatGLM, some custom decoders |

A checkpoint's layout is the one whose prefix its tensor names use; a checkpoint with none of them (or whose
layer indices do not run 0..L-1) is `ArchitectureError`, never a guess. Tensors outside the layers are "pre"
(embeddings: MergeKit takes them from the first slice's sources) or "post" (final norm, LM head: from the last
slice's sources).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from mergepipe_db.errors import ArchitectureError

#: the decoder layer prefixes known, most specific first (`model.decoder.layers.` before `model.layers.`)
LAYOUTS: tuple[str, ...] = ("model.decoder.layers.", "model.layers.", "gpt_neox.layers.", "transformer.h.",
                            "transformer.blocks.", "transformer.layers.")
#: substrings of a non-layer tensor's name that make it a "pre" tensor (embeddings), the others are "post"
_PRE_WORDS = ("embed", "wte", "wpe", "word_embeddings", "embed_in", "tok_embeddings")


@dataclass(frozen=True)
class LayerNaming:
    """A checkpoint's tensors by role: `layers[i]` the names of layer i (in checkpoint order), `pre` and `post`
    the tensors before and after the layers."""

    prefix: str
    layers: tuple[tuple[str, ...], ...]
    pre: tuple[str, ...]
    post: tuple[str, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rename(self, name: str, new_index: int) -> str:
        """`name` (a tensor of some layer) moved to layer `new_index`."""
        rest = name[len(self.prefix):]
        _idx, _, suffix = rest.partition(".")
        return f"{self.prefix}{new_index}.{suffix}"

    def suffix(self, name: str) -> str:
        """The part of a layer tensor's name after ``<prefix>N.``."""
        return name[len(self.prefix):].partition(".")[2]


def layer_naming(names: Iterable[str], *, label: str = "checkpoint") -> LayerNaming:
    """The layer naming of a checkpoint with these tensor names (checkpoint order); ArchitectureError when no
    known decoder layout fits."""
    names = list(names)
    for prefix in LAYOUTS:
        pat = re.compile(re.escape(prefix) + r"(\d+)\.")
        by_layer: dict[int, list[str]] = {}
        other: list[str] = []
        for n in names:
            m = pat.match(n)
            if m:
                by_layer.setdefault(int(m.group(1)), []).append(n)
            else:
                other.append(n)
        if not by_layer:
            continue
        n_layers = max(by_layer) + 1
        if sorted(by_layer) != list(range(n_layers)):
            missing = sorted(set(range(n_layers)) - set(by_layer))
            raise ArchitectureError(f"{label}: layers under {prefix!r} are not numbered 0..{n_layers - 1} "
                                    f"(missing {missing[:5]})")
        pre = tuple(n for n in other if any(w in n for w in _PRE_WORDS))
        post = tuple(n for n in other if n not in pre)
        return LayerNaming(prefix, tuple(tuple(by_layer[i]) for i in range(n_layers)), pre, post)
    raise ArchitectureError(f"{label}: cannot find its decoder layers: no tensor name starts with a known layer "
                            f"prefix ({', '.join(p + 'N.' for p in LAYOUTS)})")
