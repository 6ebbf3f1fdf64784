"""The files a MergeKit user finds beside the weights: `README.md` (a model card), `mergekit_config.yml` (the spec
as given), `config.json` with `torch_dtype` and `num_hidden_layers` updated, and the tokenizer and generation
files of the base (or of `tokenizer_source`). Written into the staging directory by commit, for merges whose
spec was given as YAML text (`MergeSpec.text`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mergepipe_db.core.plan import Plan
from mergepipe_db.core.units import fmt_bytes
from mergepipe_db.errors import SpecError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
_TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def write_extras(plan: Plan, staging: Path, *, model_card: bool = True) -> list[Path]:
    """Write the extras into `staging` (after commit copied the base's side files); the paths written."""
    written: list[Path] = []
    spec = plan.spec
    cfg = spec.config
    tok_source = getattr(cfg, "tokenizer_source", None)
    if tok_source not in (None, "base"):
        root = _model_root(plan, tok_source)
        for name in TOKENIZER_FILES:
            src = root / name
            dest = staging / name
            if dest.exists():
                dest.unlink()
            if src.is_file() and not src.is_symlink():
                shutil.copyfile(src, dest)
                written.append(dest)
    if not spec.copy_tokenizer:
        for name in TOKENIZER_FILES:
            (staging / name).unlink(missing_ok=True)
    conf = staging / "config.json"
    if conf.is_file():
        doc = json.loads(conf.read_text(encoding="utf-8"))
        if plan.out_dtype in _TORCH_DTYPES:
            doc["torch_dtype"] = _TORCH_DTYPES[plan.out_dtype]
        if plan.recipe is not None:
            doc["num_hidden_layers"] = plan.recipe.num_layers
        conf.unlink()  # the copy from the base may be a hard link in future: never write through it
        conf.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(conf)
    if spec.text is not None:
        (staging / "mergekit_config.yml").write_text(spec.text, encoding="utf-8")
        written.append(staging / "mergekit_config.yml")
    if model_card:
        (staging / "README.md").write_text(card_text(plan), encoding="utf-8")
        written.append(staging / "README.md")
    return written


def _model_root(plan: Plan, ref: str) -> Path:
    for c in [plan.base, *(e.checkpoint for e in plan.experts)]:
        if ref in (c.name, c.root) or (Path(ref).exists() and str(Path(ref).resolve()) == c.root):
            return Path(c.root)
    raise SpecError(f"tokenizer_source {ref!r} is not a model of this merge")


def card_text(plan: Plan) -> str:
    """The model card: YAML front matter (base_model names, tags, library_name) and what the merge did."""
    import yaml

    models = [plan.base.name] + [e.checkpoint.name for e in plan.experts]
    models = list(dict.fromkeys(models))
    front: dict[str, Any] = {"base_model": models, "library_name": "transformers",
                             "tags": ["mergekit", "merge", "mergepipe"]}
    method = plan.spec.method
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "# merged", "",
             "This is a merge of pre-trained language models created with mergepipe_db (a MergeKit-compatible,",
             "budgeted merge).", "", "## Merge Details", "", "### Merge Method", "",
             f"This model was merged using the {method} merge method"
             + (f" using {plan.base.name} as a base." if method != "passthrough" else "."), "",
             "### Models Merged", "", "The following models were included in the merge:"]
    lines += [f"* {m}" for m in models]
    lines += ["", "### Budget", "",
              f"Expert-read budget {fmt_bytes(plan.budget_bytes)} of a full read of {fmt_bytes(plan.full_bytes)};"
              f" {fmt_bytes(plan.planned_bytes)} of expert bytes read.", "", "### Configuration", "",
              "The following YAML configuration was used to produce this model:", "", "```yaml",
              (plan.spec.text or "").rstrip(), "```", ""]
    return "\n".join(lines)
