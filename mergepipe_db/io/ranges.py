"""The one range merger: byte ranges that follow each other in a file become one read request."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar


class ByteRange(Protocol):
    """Anything with a byte `offset` and a length `nbytes` (a plan's `Read`, a read-ahead's request)."""

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


R = TypeVar("R", bound=ByteRange)


def coalesce(ranges: Iterable[R], *, limit: int | None = None,
             file: Callable[[R], object] | None = None) -> Iterator[tuple[int, int, list[R]]]:
    """Runs of byte-adjacent ranges, in the order given: (offset, nbytes, members) each.

    A range joins the run before it when it starts where that run ends, in the same file (`file` tells each
    range's file; without it all lie in one) and the run then spans at most `limit` bytes (a range larger
    than `limit` is a run of its own). Lazy: it looks at most one range past the run it yields, so a caller
    may take the first run of a queue and pop its members."""
    it = iter(ranges)
    first = next(it, None)
    if first is None:
        return
    lo, hi, members = first.offset, first.offset + first.nbytes, [first]
    where = file(first) if file is not None else None
    for r in it:
        off = r.offset
        if (off == hi and (limit is None or off + r.nbytes - lo <= limit)
                and (file is None or file(r) == where)):
            members.append(r)
            hi = off + r.nbytes
            continue
        yield lo, hi - lo, members
        lo, hi, members = off, off + r.nbytes, [r]
        if file is not None:
            where = file(r)
    yield lo, hi - lo, members
