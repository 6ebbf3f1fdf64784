"""`io.heap.retained_heap`: inside it, memory a merge frees is reused without faulting in fresh pages; after it,
glibc's defaults are back and a large block costs fresh pages again. Counted by the kernel (the process's minor
page faults), not by the code under test."""

from __future__ import annotations

import ctypes
import resource
import threading

import pytest

from mergepipe_db.errors import EnvironmentSettingError
from mergepipe_db.io import heap

pytestmark = pytest.mark.skipif(heap._glibc() is None, reason="the heap policy is glibc's mallopt")

_BLOCK = 96 << 20  # well above glibc's largest mmap threshold (32 MiB)
_PAGES = _BLOCK // 4096


def _faults_of_one_block() -> int:
    """Minor page faults while a block of `_BLOCK` bytes is allocated, written and freed (glibc's malloc)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(_BLOCK)
    libc.memset(p, 1, _BLOCK)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_pages_are_reused_inside_and_given_back_after() -> None:
    assert _faults_of_one_block() > _PAGES // 2  # the default: fresh pages for every large block
    with heap.retained_heap():
        _faults_of_one_block()
        assert _faults_of_one_block() < _PAGES // 20  # the pages of the block before
    assert _faults_of_one_block() > _PAGES // 2


def test_nested_and_concurrent_holders_keep_it_until_the_last_leaves() -> None:
    entered, leave = threading.Event(), threading.Event()

    def other_merge() -> None:
        with heap.retained_heap():
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=other_merge)
    with heap.retained_heap():
        t.start()
        assert entered.wait(30)
        with heap.retained_heap():
            _faults_of_one_block()
    # this thread's holds are gone, the other's is not
    assert _faults_of_one_block() < _PAGES // 20
    leave.set()
    t.join(30)
    assert _faults_of_one_block() > _PAGES // 2


def test_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERGEPIPE_RETAIN_HEAP", "0")
    with heap.retained_heap():
        assert _faults_of_one_block() > _PAGES // 2


@pytest.mark.parametrize("value", ["yes", "2", "-1"])
def test_a_bad_setting_is_a_named_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MERGEPIPE_RETAIN_HEAP", value)
    with pytest.raises(EnvironmentSettingError) as ei, heap.retained_heap():
        pass
    assert "MERGEPIPE_RETAIN_HEAP" in str(ei.value) and len(str(ei.value).splitlines()) == 1
