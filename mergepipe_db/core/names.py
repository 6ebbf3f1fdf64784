"""The name rules: tensor names (opaque keys with a few refusals) and checkpoint names, and how a name or path is
shown in a one-line error."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from mergepipe_db.errors import BadCheckpointError, BadTensorNameError


def validate_checkpoint_name(name: str) -> None:
    """A name users give a checkpoint (ingest) or a merge's ref: a usable key (`validate_tensor_name`'s rules),
    without '@', which only snapshot names hold (``<ref>@<version>``: a name ``a@1`` would be taken for ref
    ``a``'s first snapshot), and without whitespace at either end. BadCheckpointError otherwise."""
    from mergepipe_db.core.names import show_name, validate_tensor_name

    try:
        validate_tensor_name(name, "checkpoint name")
    except BadCheckpointError as e:
        raise BadCheckpointError(str(e)) from None
    if "@" in name:
        raise BadCheckpointError(f"checkpoint name {show_name(name)} holds '@', which only snapshot names "
                                 f"(<ref>@<version>) hold; choose another name")
    if name != name.strip():
        raise BadCheckpointError(f"checkpoint name {show_name(name)} starts or ends with whitespace")


#: Longest tensor name accepted, in UTF-8 bytes.
MAX_NAME_BYTES = 1024


#: Unicode category Cc is exactly these two ranges.
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def show_text(text: str, limit: int = 200) -> str:
    """`text` made safe for a one-line message: control and line-separator characters escaped, truncated."""
    out = []
    for ch in text[:limit]:
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp", "Cs"):
            out.append(ch.encode("unicode_escape", "backslashreplace").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out) + ("..." if len(text) > limit else "")


def show_name(name: str) -> str:
    """A tensor or file name quoted for a one-line error message."""
    return "'" + show_text(name) + "'"


def show_path(path: Path | str) -> str:
    """A path made safe for a one-line error message."""
    return show_text(str(path), limit=400)


def validate_tensor_name(name: str, what: str = "tensor name") -> None:
    """Raise `BadTensorNameError` unless `name` is a usable opaque tensor key (`what` names it in the message).

    Refused: non-strings, the empty string, more than 1,024 UTF-8 bytes, text that is not encodable as
    UTF-8 (lone surrogates), and any control character (Unicode category Cc, which includes NUL).
    Everything else (quotes, ';', '/', '..', spaces, non-ASCII) is accepted and kept exactly.
    """
    if not isinstance(name, str):
        raise BadTensorNameError(f"{what} {name!r} is not a string")
    if not name:
        raise BadTensorNameError(f"{what} is empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadTensorNameError(f"{what} {show_name(name)} is not valid Unicode") from None
    if size > MAX_NAME_BYTES:
        raise BadTensorNameError(
            f"{what} {show_name(name[:40])} is {size} UTF-8 bytes, over the {MAX_NAME_BYTES}-byte limit"
        )
    bad = CONTROL_CHARS.search(name)
    if bad is not None:
        raise BadTensorNameError(
            f"{what} {show_name(name)} holds control character U+{ord(bad.group()):04X}"
        )
