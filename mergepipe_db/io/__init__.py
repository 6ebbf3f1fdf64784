"""Byte stores: where checkpoint and output bytes live, and the one way to read and write them.

`open_store(location)` picks a `ByteStore` by the location's URI scheme (`SCHEMES`; a plain path is local,
`io/local.py`). A store can `stat` a location (size and a version: the mtime in ns for a local file, an ETag
for an object store), hand out a counting range reader (`range_reader`: `read_aligned`, `read_into`, `read`,
`bytes_read`, `bytes_cached`), a sequential reader and a read-ahead for ingest, open a location for a few
reads (`open_input`: a header, a tensor's pieces), hash it (`sha256`), write a file (`writer`, O_DIRECT where
asked and allowed), create a small one (`write_new`), make one durable (`sync`) and `publish` a staging
directory (rename + fsync). `coalesce` is the one range merger (adjacent ranges become one request).
``s3://bucket/key`` locations are objects in S3-compatible storage (`io/s3.py`, obstore); `range_reader`
gives a reader that sends each path's ranges to its own store's reader (a local base, experts in S3), and
`as_path` turns a location into a path object (`io.s3.ObjectPath` for a URI).

The rule: no module outside `io` opens, reads or writes a checkpoint's or an output's data files; they go
through a store (there is one pread loop, `io.local.pread_into`). Small JSON side files (config.json, the
shard index, adapter_config.json, manifest.json) are read with `read_small` (the formats modules) or, where a
module reads a manifest as text, with `Path.read_text`; the catalog's own files and temporary files are not
byte-store data.
"""

from __future__ import annotations

from mergepipe_db.io.base import (
    SCHEMES,
    ByteStore,
    InputFile,
    Location,
    MultiReader,
    OutputFile,
    RangeSource,
    Stat,
    as_path,
    check_fresh,
    is_remote,
    open_store,
    range_reader,
    scheme_of,
)
from mergepipe_db.io.ranges import coalesce

__all__ = [
    "SCHEMES",
    "ByteStore",
    "InputFile",
    "Location",
    "MultiReader",
    "OutputFile",
    "RangeSource",
    "Stat",
    "as_path",
    "check_fresh",
    "coalesce",
    "is_remote",
    "open_store",
    "range_reader",
    "scheme_of",
]
