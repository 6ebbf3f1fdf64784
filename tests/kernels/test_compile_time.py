"""The compile-time note: numba's compilations of this process are counted (not its cache loads), and the commands
say how long a run spent compiling only to a person at a terminal, only about their own run."""

from __future__ import annotations

import io

import numba
import numpy as np

from mergepipe_db import cli, yaml_cli
from mergepipe_db.kernels import compile_time


def test_a_compilation_is_counted_once_with_the_functions_it_calls() -> None:
    compile_time.watch()
    compile_time.watch()  # once: a second listener would count every compilation twice

    @numba.njit  # not cached: compiled at its first call in this process
    def inner(x):  # noqa: ANN001, ANN202
        return x * 2.0

    @numba.njit
    def outer(a):  # noqa: ANN001, ANN202
        s = 0.0
        for v in a:
            s += inner(v)
        return s

    before = compile_time.compiled()
    assert outer(np.arange(4.0)) == 12.0
    count, seconds = compile_time.compiled()
    assert count - before[0] == 1  # inner compiled inside outer's compilation: one outermost
    assert seconds > before[1]
    assert outer(np.arange(3.0)) == 6.0  # the same signature: nothing compiled
    assert compile_time.compiled()[0] == count


def test_the_note_covers_only_what_came_after_since(monkeypatch) -> None:
    monkeypatch.setattr(compile_time, "compiled", lambda: (12, 9.5))
    assert compile_time.note((12, 9.2)) is None  # 0.3 s: not worth a line
    line = compile_time.note((2, 1.0))
    assert line is not None and "8.5 s" in line and "10 kernel(s)" in line and "\n" not in line


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_commands_say_it_on_a_terminal_only(monkeypatch, tmp_path) -> None:
    """`mergepipe` and `mergepipe-yaml` print the note after a run that compiled for a second or more, on a
    terminal; piped (scripts, CI logs, these tests' captures) they print nothing more. What earlier runs in the
    same process compiled is not theirs to report."""
    total = [(7, 40.0)]  # compiled before the command, in this process

    def run(_args):  # noqa: ANN001, ANN202 - the command: compiles 5 kernels in 3.2 s
        total[0] = (total[0][0] + 5, total[0][1] + 3.2)
        return _Result()

    monkeypatch.setattr(compile_time, "compiled", lambda: total[0])
    monkeypatch.setattr(cli, "cmd_init", lambda args: 0 if run(args) else 1)
    monkeypatch.setattr(yaml_cli, "load", lambda args, cat: (None, 0))
    monkeypatch.setattr("mergepipe_db.catalog.Catalog.open", classmethod(lambda cls, url: _FakeCatalog(run)))
    for terminal in (True, False):
        err = _Terminal() if terminal else io.StringIO()
        monkeypatch.setattr("sys.stderr", err)
        assert cli.main(["init", "--catalog", str(tmp_path / "c.duckdb")]) == 0
        assert ("mergepipe: note: 3.2 s of this run went to compiling 5 kernel(s)" in err.getvalue()) == terminal
        err = _Terminal() if terminal else io.StringIO()
        monkeypatch.setattr("sys.stderr", err)
        assert yaml_cli.main([str(tmp_path / "m.yml"), str(tmp_path / "out"), "--json"]) == 0
        assert ("mergepipe-yaml: note: 3.2 s of this run went to compiling 5 kernel(s)" in err.getvalue()) == terminal


class _Result:
    def to_dict(self) -> dict:
        return {}


class _FakeCatalog:
    def __init__(self, run) -> None:  # noqa: ANN001
        self._run = run

    def merge(self, spec, **kwargs):  # noqa: ANN001, ANN003, ANN201
        return self._run(spec)
