"""Model references in Hugging Face form (`org/name`, `org/name@revision`) resolved to a directory of the local
Hugging Face cache (the `HF_HOME` / `HF_HUB_CACHE` layout, through `huggingface_hub`), offline; a missing model
is downloaded (its safetensors, config and tokenizer files only) only when asked."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mergepipe_db.errors import SpecError

#: what a download fetches: the weights as safetensors (never pickles), the config, generation and tokenizer files
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json"]
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


def is_hf_ref(ref: str) -> bool:
    """`org/name` or `org/name@revision` that is not a path on disk."""
    return bool(_HF_ID.match(ref)) and not Path(ref.split("@")[0]).exists()


def hub_cache_dir() -> str | None:
    """The hub cache the environment names now: HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub (None:
    huggingface_hub's default). huggingface_hub reads them once, when it is first imported; a process that set
    them later (a library caller, a test) would otherwise look in the cache of its start."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.environ[var]
    home = os.environ.get("HF_HOME")
    return str(Path(home) / "hub") if home else None


def resolve_hf(ref: str, *, download: bool = False) -> Path:
    """The local snapshot directory of `ref`; SpecError when it is not cached (and `download` is off) or cannot
    be fetched."""
    if "+" in ref:
        raise SpecError(f"model {ref!r}: MergeKit's model+LoRA references are not supported; ingest the adapter "
                        f"and merge it as an expert")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, revision = ref.partition("@")
    try:
        path = snapshot_download(repo, revision=revision or None, local_files_only=not download,
                                 allow_patterns=ALLOW_PATTERNS, cache_dir=hub_cache_dir())
    except LocalEntryNotFoundError as e:
        raise SpecError(f"model {ref!r} is not in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME); pass "
                        f"--download to fetch its safetensors, config and tokenizer files") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise SpecError(f"model {ref!r}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from e
    return Path(path)
