"""How the command lines (`python -m sentinels ...`, `python -m sentinels.launch ...`) report errors.

Bad input (a config, a data file, an out_dir, a checkpoint, a GO record, an argument, a missing optional package)
is one line on stderr that names the file or the field and the rule, and exit code 2, with no traceback;
`--debug` adds the traceback.
Ctrl-C outside the training loop (where it stops the run with a checkpoint) is one line and exit code 130. Any
other exception is a bug or a failing machine and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class InputError(Exception):
    """Base of the errors that mean bad input (ConfigError, DataError, TrainerError, TokenizerUnavailable, ...)."""


class ReportedElsewhere(InputError):
    """Bad input that another process reports (rank 0 of a distributed run says it once): exit code 2, no line."""


BAD_INPUT_ERRORS = (InputError, ValueError, OSError, ImportError)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print the traceback as well as the one-line message")


def run_reporting_errors(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """command(args), with bad input and Ctrl-C turned into one line and an exit code (module docstring)."""
    debug = getattr(args, "debug", False)
    try:
        return command(args)
    except KeyboardInterrupt as exc:
        if debug:
            traceback.print_exc()
        print(f"interrupted: {one_line(exc) if str(exc) else 'Ctrl-C'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BAD_INPUT_ERRORS as exc:
        if debug:
            traceback.print_exc()
        if not isinstance(exc, ReportedElsewhere):
            print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
