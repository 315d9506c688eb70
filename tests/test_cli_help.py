"""Every flag and positional argument of every `openglm` command documents itself."""

import argparse
import re

from openglm.cli import build_parser

# A default worth stating is shown as "(default ...)" / "default: ..." or argparse's %(default)s.
_STATES_DEFAULT = re.compile(r"default|%\(default\)s", re.I)


def _walk(parser: argparse.ArgumentParser, prog: str = "openglm"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{prog} {name}")
        else:
            yield prog, action


def _name(action) -> str:
    return "/".join(action.option_strings) or action.dest


def test_every_argument_has_help_text():
    missing = [f"{prog} {_name(a)}" for prog, a in _walk(build_parser())
               if not isinstance(a, argparse._HelpAction) and not (a.help and a.help.strip())]
    assert not missing, "arguments without help text:\n" + "\n".join(missing)


def test_every_non_trivial_default_is_stated():
    unstated = []
    for prog, a in _walk(build_parser()):
        trivial = a.default in (None, False, [], argparse.SUPPRESS) or a.nargs == 0 or not a.option_strings
        if not trivial and a.help and not _STATES_DEFAULT.search(a.help):
            unstated.append(f"{prog} {_name(a)} (default {a.default!r})")
    assert not unstated, "options whose help does not state the default:\n" + "\n".join(unstated)


def test_every_command_answers_help(capsys):
    import pytest

    parser = build_parser()
    progs = sorted({prog for prog, _ in _walk(parser)})
    assert len(progs) > 15  # the walk reached the nested subcommands (task submit, index build, ...)
    for prog in progs:
        with pytest.raises(SystemExit) as exit:
            parser.parse_args(prog.split()[1:] + ["--help"])
        assert exit.value.code == 0, prog
        assert capsys.readouterr().out.startswith("usage: " + prog.split(" ", 1)[0]), prog
