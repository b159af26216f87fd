"""What every gems command shares: user errors become one line on stderr and exit code 2.

A command's ``main`` parses its arguments with :func:`parser` (argparse already prints
``prog: error: ...`` and exits 2 on a bad flag) and hands the work to :func:`run`, which
turns a :class:`~gems.errors.GemsError` into ``prog: error: <sentence>`` with no traceback.
Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from gems.errors import GemsError

USER_ERROR = 2  # the exit status of argparse for bad usage; gems uses it for every user error


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line naming the problem (argparse's default also prints the whole usage)."""
        self.exit(USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with gems' conventions: defaults shown in --help, and a bad flag
    reported in one line with exit status 2."""
    return _Parser(prog=prog, description=description,
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def checked(convert: Callable[[str], object]) -> Callable[[str], object]:
    """Wrap an argument converter so its GemsError reads as argparse's "invalid value" error."""
    def convert_argument(text: str) -> object:
        try:
            return convert(text)
        except GemsError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert_argument.__name__ = getattr(convert, "__name__", "value")
    return convert_argument


def run(prog: str, body: Callable[[], int | None]) -> int:
    """Run a command's body; return its exit status (0 when it returns None).

    GemsError -> ``prog: error: <message>`` on stderr and status 2; Ctrl-C -> status 130.
    """
    try:
        status = body()
    except GemsError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0 if status is None else int(status)
