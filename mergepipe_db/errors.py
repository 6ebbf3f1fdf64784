"""The error hierarchy. Every failure a user can cause is a `MergePipeError` subclass.

The CLI turns any `MergePipeError` into one line on stderr and exit code 1 (see `cli.main`).
Messages are one line, say what was wrong and, where there is one, what fixes it.
"""

from __future__ import annotations


class MergePipeError(Exception):
    """Root of every error mergepipe_db raises on purpose."""

    #: True when running the same command again may succeed (lost race, lock held).
    retryable: bool = False


# --- input files -------------------------------------------------------------------------------


class BadCheckpointError(MergePipeError):
    """A checkpoint file or directory is malformed or not supported."""


class SafetensorsFormatError(BadCheckpointError):
    """A .safetensors file violates the format (header, offsets, sizes, dtypes)."""


class BadTensorNameError(SafetensorsFormatError):
    """A tensor name is empty, longer than 1,024 bytes, or holds NUL/control characters."""


class ShardIndexError(BadCheckpointError):
    """A `model.safetensors.index.json` is malformed, escapes its directory or disagrees with the shards."""


class PickleRefusedError(BadCheckpointError):
    """A pickle-based checkpoint (.bin/.pt/.pth/.ckpt) was given; it is never unpickled."""


class CoordinateMismatchError(BadCheckpointError):
    """An expert does not share its base's coordinates (tensor names, shapes, dtypes)."""


class UnsupportedDtypeError(BadCheckpointError):
    """Arithmetic was requested on a dtype that is catalogued but not computable (F8, integers, ...)."""


# --- catalog -----------------------------------------------------------------------------------


class CatalogError(MergePipeError):
    """The catalog database cannot be used as asked."""


class CatalogOutOfDateError(CatalogError):
    """The catalog schema is older (or newer) than this version of mergepipe_db."""


class CatalogLockedError(CatalogError):
    """Another process held the catalog lock longer than the retry window."""

    retryable = True


class UnknownCheckpointError(CatalogError):
    """A checkpoint or snapshot name/id is not in the catalog."""


class DuplicateNameError(CatalogError):
    """A name is already used by a checkpoint with other content."""


class ReadOnlySqlError(CatalogError):
    """A `mergepipe sql` query tried to write or to reach outside the catalog."""


# --- sources and integrity ---------------------------------------------------------------------


class StaleSourceError(MergePipeError):
    """A source file changed (size or mtime) since it was ingested."""


class UnsupportedStorageError(MergePipeError):
    """A location names a storage scheme (``s3://``, ...) that no byte store implements (`io.SCHEMES`)."""


class IntegrityError(MergePipeError):
    """Bytes read do not match the hashes recorded in the catalog or a manifest."""


# --- merge -------------------------------------------------------------------------------------


class SpecError(MergePipeError):
    """A merge spec (YAML) is invalid."""


class BudgetError(SpecError):
    """A budget is negative, unparsable, or otherwise unusable."""


class MethodParameterError(SpecError):
    """A merge method's parameters break its constraints (MergeKit's): the message names the parameter."""


class PlanExecutionMismatchError(MergePipeError):
    """Realized expert bytes differ from the plan: the budget-soundness invariant was violated."""


class OutputExistsError(MergePipeError):
    """The output directory exists and is not empty."""


class CommitConflictError(MergePipeError):
    """Another writer moved the ref first (compare-and-set lost); refresh and retry."""

    retryable = True


class OutOfSpaceError(MergePipeError):
    """The output filesystem ran out of space; nothing was published."""


class ReplayError(MergePipeError):
    """A manifest cannot be replayed (inputs changed, manifest malformed)."""


class VerifyError(MergePipeError):
    """Verification found files or tensors that differ from the record."""


# --- safetensors format details (formats/safetensors.py, formats/hf_layout.py) ------------------


class HeaderLengthError(SafetensorsFormatError):
    """File shorter than 8 bytes, or header length 0, over the cap, overflowing or past end of file."""


class HeaderEncodingError(SafetensorsFormatError):
    """The header bytes are not valid UTF-8."""


class HeaderJsonError(SafetensorsFormatError):
    """The header is not a JSON object (bad JSON, bad padding, not an object)."""


class DuplicateKeyError(HeaderJsonError):
    """The header JSON repeats a key in some object."""


class MetadataError(SafetensorsFormatError):
    """`__metadata__` is not an object of string to string."""


class TensorEntryError(SafetensorsFormatError):
    """A tensor entry is not exactly {dtype: str, shape: [int>=0], data_offsets: [int>=0, int>=0]}."""


class UnknownDtypeError(SafetensorsFormatError):
    """A dtype name is not one the safetensors format defines."""


class OffsetError(SafetensorsFormatError):
    """Tensor data offsets are reversed, overlap, leave a gap, or do not start at 0."""


class SizeMismatchError(SafetensorsFormatError):
    """A tensor's byte range differs from shape x dtype (or is not a whole number of bytes)."""


class TrailingBytesError(SafetensorsFormatError):
    """The file holds bytes after the last tensor's data."""


class TruncatedDataError(SafetensorsFormatError):
    """The file ends before the last tensor's data does."""


class SafetensorsWriteError(SafetensorsFormatError):
    """A safetensors writer was given tensors out of order, with the wrong size, or closed early."""


class SymlinkEscapeError(BadCheckpointError):
    """A checkpoint file is a symlink that resolves outside the checkpoint directory."""


class ShardSymlinkEscapeError(ShardIndexError, SymlinkEscapeError):
    """A shard named by the index is a symlink that resolves outside the checkpoint directory."""


class LoraAdapterError(BadCheckpointError):
    """A LoRA adapter that cannot be used: missing adapter_config.json or weights, an unknown module, or
    factor shapes that disagree with the config's rank or with the base tensor."""


class PackError(MergePipeError):
    """The packed block store cannot hold or serve an expert (not a full checkpoint, store missing, …)."""
