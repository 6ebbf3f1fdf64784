"""The error hierarchy. Every failure a user can cause is a `MergePipeError` subclass.

The CLI turns any `MergePipeError` into one line on stderr and exit code 1 (see `cli.main`); usage errors
(unknown option, missing argument) are argparse's and exit 2.
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


class SqlSyntaxError(CatalogError):
    """A `mergepipe sql` query is not valid SQL (it does not parse)."""


class AlreadyCataloguedError(DuplicateNameError):
    """The content being ingested is already catalogued under another name (ingest is by content)."""


class CatalogNotFoundError(CatalogError):
    """A command that only reads or merges was pointed at a catalog that does not exist (only `init`,
    `ingest`, `demo` and `db upgrade` create one)."""


class UnsupportedCatalogUrlError(CatalogError):
    """A catalog URL names a database scheme mergepipe does not support (e.g. ``sqlite://``)."""


# --- sources and integrity ---------------------------------------------------------------------


class StaleSourceError(MergePipeError):
    """A source file changed (size or mtime) since it was ingested."""


class UnsupportedStorageError(MergePipeError):
    """A location names a storage scheme (``s3://``, ...) that no byte store implements (`io.SCHEMES`)."""


class StoreError(MergePipeError):
    """An object store (``s3://``) refused or failed a request; nothing was made visible."""


class StorageConfigError(StoreError):
    """A storage location or its settings are unusable: a malformed ``s3://`` URI, missing credentials, an
    unknown ``--storage-option``."""


class StoreNotFoundError(StoreError):
    """The bucket or the object does not exist."""


class StoreAccessDeniedError(StoreError):
    """The store refused the credentials or the request (403/401)."""


class StoreUnreachableError(StoreError):
    """The store's endpoint could not be reached (connection refused, DNS, timeout) after retries."""


class StoreThrottledError(StoreError):
    """The store kept answering "slow down" (503/429) after retries."""


class IntegrityError(MergePipeError):
    """Bytes read do not match the hashes recorded in the catalog or a manifest."""


# --- merge -------------------------------------------------------------------------------------


class SpecError(MergePipeError):
    """A merge spec (YAML) is invalid."""


class ArchitectureError(SpecError):
    """A config names layers of a checkpoint whose decoder layer naming is not known (core/arch.py)."""


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


class DistributedError(MergePipeError):
    """A distributed merge cannot run: no such Dask scheduler, a bad worker count, the cluster went away."""


class WorkerLostError(DistributedError):
    """A Dask worker died while executing a part of a merge more often than the scheduler retries it
    (`distributed.scheduler.allowed-failures`); nothing was published."""


class OutOfSpaceError(MergePipeError):
    """The output filesystem ran out of space; nothing was published."""


class ReplayError(MergePipeError):
    """A manifest cannot be replayed (inputs changed, manifest malformed)."""


class VerifyError(MergePipeError):
    """Verification found files or tensors that differ from the record."""


class UnsupportedOutputFormatError(MergePipeError):
    """An output file's extension names a format the command does not write (`report --out x.pdf`)."""


class ReportPathError(MergePipeError):
    """A report's output path cannot be written (its directory does not exist)."""


class StaleOutputError(VerifyError):
    """A committed snapshot's output files moved or changed since the commit (a report would show stale
    figures)."""


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


class EnvironmentSettingError(MergePipeError):
    """A ``MERGEPIPE_*`` environment variable has a value it cannot take (``MERGEPIPE_REUSE_BYTES``: not a
    whole number of bytes ≥ 0; ``MERGEPIPE_RETAIN_HEAP``: not 0 or 1)."""
