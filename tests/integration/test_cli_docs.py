"""Every command has --help text and is documented in the README (sqlite-utils style docs test)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mergepipe_db.cli import build_parser, main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    parser = build_parser()
    out = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
                if nested:
                    out += [(f"{name} {n}", s) for n, s in nested[0].choices.items()]
                else:
                    out.append((name, sub))
    return out


@pytest.mark.parametrize("name,sub", _commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_command_has_help_and_is_in_the_readme(name: str, sub: argparse.ArgumentParser, capsys) -> None:
    assert sub.description, f"`mergepipe {name}` has no description"
    for action in sub._actions:  # noqa: SLF001
        if action.option_strings and action.dest != "help":
            assert action.help, f"`mergepipe {name}` option {action.option_strings} has no help"
    with pytest.raises(SystemExit) as e:
        main([*name.split(), "--help"])
    assert e.value.code == 0 and "usage: mergepipe" in capsys.readouterr().out
    assert re.search(rf"mergepipe {re.escape(name)}\b", README), f"README does not document `mergepipe {name}`"
