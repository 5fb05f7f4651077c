"""The experiment scripts' command lines: one help formatter, one parent parser of the flags every script shares,
and the registry's system names as an argparse type.

Nothing here imports torch (nor the registry, the simulator or pandas at import time): a script builds its parser
from this module, :mod:`lrmoe.checks`' argument types and :mod:`lrmoe.config`'s presets, and imports the heavy
modules inside the function that runs the work, so ``--help`` and argument errors come back at once
(tests/test_cli.py holds every script to this).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence

from lrmoe.checks import check_fraction, check_positive_number, non_negative_int, positive_int
from lrmoe.integrations.tracking_args import add_tracking_args


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of the description (a script's docstring) and appends each flag's default to its help.

    The default is left out where it says nothing: a switch (``store_true``), ``None`` (the help says what happens
    when the flag is not given), an empty list, or a help that already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        silent = (default is None or default is False or default is argparse.SUPPRESS
                  or (isinstance(default, (list, tuple)) and not default)
                  or "default" in text.lower() or not action.option_strings)
        if silent:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def tracking_parent(default_results: str) -> argparse.ArgumentParser:
    """The parent parser of the flags every experiment script shares (results file, overwrite/resume, W&B), with
    ``default_results`` as --out's default. Built per script: argparse shares a parent's actions with its children,
    so one parser object would carry the last script's default."""
    parent = argparse.ArgumentParser(add_help=False)
    add_tracking_args(parent, default_results)
    return parent


def script_parser(description: str | None, default_results: str | None = None,
                  **kwargs) -> argparse.ArgumentParser:
    """A script's parser: :class:`HelpFormatter`, the script's docstring as description, and the shared flags of
    :func:`tracking_parent` when the script writes a results file (``default_results``: where, by default)."""
    parents = [tracking_parent(default_results)] if default_results is not None else []
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter, parents=parents,
                                   **kwargs)


def system_arg(value: str) -> str:
    """argparse ``type=`` of a system name: its registry name, or an argparse error listing the known ones. The
    registry (which builds policies, and so imports torch) is imported when a name is parsed, not for ``--help``."""
    from lrmoe.systems import system_arg as registry_system_arg

    return registry_system_arg(value)


SYSTEMS_HELP = ("names in the registry, lrmoe.systems (older names are accepted; an unknown name is an error listing "
                "the known ones)")


def one_of(names: Callable[[], Iterable[str]], what: str = "value") -> Callable[[str], str]:
    """argparse ``type=`` of one of ``names()``: the list comes from a heavy module (the simulator's overheads, the
    byte model's modes), so it is read when a value is parsed, never for ``--help``; anything else is an argparse
    error listing the names."""
    def parse(value: str) -> str:
        known = tuple(names())
        if value not in known:
            raise argparse.ArgumentTypeError(f"{what} {value!r} is not one of {', '.join(known)}")
        return value
    return parse


class StageFailed(SystemExit):
    """A stage run by :func:`run_entry` failed: the caller's ``SystemExit`` (its message names the stage), with the
    stage's own exit status in ``status``, for a caller that passes it on."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def run_entry(caller: str, stage: str, entry: Callable[[list[str]], object], argv: Sequence[str]) -> object:
    """Run another script's command line ``argv`` in this process through its entry point: ``entry`` is the script's
    ``cli`` (it returns an exit status) or its ``main`` (it returns the script's result, returned here). The way one
    script (``caller``, e.g. ``"convergence.py"``) runs another (``stage``, e.g. ``"train.py"``): the orchestrator
    imports the stage's module, so the dependency is in the import graph (named in the contracts) and holds in an
    installed package, where no script lies at a path of its own.

    A failing stage fails the caller with a message naming the stage and its arguments: a non-zero exit status or
    ``SystemExit`` (an argparse error, a script's own ``error: ...``) becomes the caller's :class:`StageFailed` (a
    ``SystemExit`` that keeps the stage's status); any other exception propagates with a note naming the stage
    (``KeyboardInterrupt`` as it is). While it runs, ``sys.argv`` is the stage's command line, so that its parser's
    usage and errors name the stage, not the caller."""
    argv = list(argv)
    command = " ".join([stage, *argv])
    outer, sys.argv = sys.argv, [stage, *argv]  # as from its command line: its usage and errors name the stage
    try:
        result = entry(argv)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return None
        why = f"exited with {exc.code}" if isinstance(exc.code, int) else str(exc.code)
        raise StageFailed(f"{caller}: error: {command} failed: {why}",
                          exc.code if isinstance(exc.code, int) else 1) from None
    except Exception as exc:
        exc.add_note(f"{caller}: in the stage {command}")
        raise
    finally:
        sys.argv = outer
    if isinstance(result, int) and not isinstance(result, bool) and result:  # a cli's exit status
        raise StageFailed(f"{caller}: error: {command} failed: exited with {result}", result)
    return result


# -- command-line number types (argparse ``type=``): a bad value is an argparse error naming the flag, never a
# traceback; the checks themselves are lrmoe.checks'

def _arg(check, kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an int' if kind is int else 'a number'}: {text!r}") from None
        try:
            return check("value", value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).replace("value ", "", 1)) from None
    return parse


positive_int_arg = _arg(positive_int, int)
non_negative_int_arg = _arg(non_negative_int, int)
positive_float_arg = _arg(check_positive_number, float)


non_negative_float_arg = _arg(lambda name, value: check_fraction(name, value, None), float)
fraction_arg = _arg(lambda name, value: check_fraction(name, value, 1.0), float)  # a number in [0, 1]
