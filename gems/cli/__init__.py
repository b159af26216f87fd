"""What every gems command shares: user errors become one line on stderr and exit code 2.

A command's ``main`` parses its arguments with :func:`parser` (argparse already prints
``prog: error: ...`` and exits 2 on a bad flag) and hands the work to :func:`run`, which
turns a :class:`~gems.errors.GemsError` into ``prog: error: <sentence>`` with no traceback.
Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import typing
from collections.abc import Callable

from gems.errors import USER_ERROR, GemsError, one_line
from gems.train import configfile



class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line naming the problem (argparse's default also prints the whole usage)."""
        self.exit(USER_ERROR, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with gems' conventions: defaults shown in --help, and a bad flag
    reported in one line with exit status 2."""
    return _Parser(prog=prog, description=description,
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


class _ConfigParser(_Parser):
    """A dataclass parser that also reads ``--config FILE`` (TOML, ``gems.train.configfile``): the
    file's values become the defaults, so flags on the command line override them; where the
    dataclass has ``plan_defaults`` and a ``--plan FILE`` is given (on the command line or in the
    file), the plan's layout is the default beneath the file's values; and answers
    ``--print-config`` with the resolved configuration as TOML (exit 0). Neither reaches the
    namespace: it holds the dataclass's fields alone."""

    config: type

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        early = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
        early.add_argument("--config")
        early.add_argument("--plan")
        try:
            found, _ = early.parse_known_args(args)
        except argparse.ArgumentError:   # e.g. --plan without its file: the full parse says so, in one line
            found = argparse.Namespace(config=None, plan=None)
        try:
            values = configfile.read(found.config, self.config) if found.config is not None else {}
            plan = found.plan or values.get("plan")
            if plan and hasattr(self.config, "plan_defaults"):   # the plan's layout under the file's values
                self.set_defaults(**self.config.plan_defaults(plan))
            self.set_defaults(**values)
        except GemsError as error:
            self.exit(USER_ERROR, f"{self.prog}: error: {one_line(error)}\n")
        namespace, extra = super().parse_known_args(args, namespace)
        del namespace.config
        if namespace.__dict__.pop("print_config"):
            print(configfile.dumps(self.config(**vars(namespace))), end="")
            self.exit(0)
        return namespace, extra


def dataclass_parser(prog: str, description: str, config: type) -> argparse.ArgumentParser:
    """A parser with one flag per field of the ``config`` dataclass (``batch_size`` ->
    ``--batch-size``): type, default, choices and help come from the field (see gems.train.config.opt);
    booleans get ``--x/--no-x``; ``tuple[str, ...]`` fields are repeatable flags; a field with a
    ``const`` takes ``--x [CHOICE]``, the flag alone meaning ``const``, and ``--no-x`` meaning its
    ``negative`` (``--split-backward [auto|on|off]``, once a boolean: its command lines stay valid).
    ``--config FILE`` and ``--print-config`` come with it (``_ConfigParser``)."""
    p = _ConfigParser(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.config = config
    p.add_argument("--config", metavar="FILE", help="a TOML file of options, keys named as the options with "
                   "underscores (batch_size = 4); flags on the command line override it")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML (options "
                   "left unset omitted) and exit")
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = hints[f.name]
        if configfile.value_type(kind) is bool:   # bool | None: None unless --x or --no-x
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
            continue
        if "const" in f.metadata:
            p.add_argument(flag, nargs="?", const=f.metadata["const"], default=default,
                           choices=f.metadata.get("choices"), help=f.metadata["help"])
            p.add_argument("--no-" + flag[2:], dest=f.name, action="store_const", const=f.metadata["negative"],
                           default=argparse.SUPPRESS, help=f"the same as {flag} {f.metadata['negative']}")
            continue
        if typing.get_origin(kind) is tuple:   # tuple[str, ...]: a repeatable flag, values in order
            p.add_argument(flag, action=_Collect, default=default, metavar=f.metadata.get("metavar"),
                           help=f.metadata["help"] + " (repeatable)")
            continue
        base = configfile.value_type(kind)
        p.add_argument(flag, type=base, default=default, choices=f.metadata.get("choices"),
                       help=f.metadata["help"])
    return p


class _Collect(argparse.Action):
    """Appends each occurrence of a repeatable flag to the tuple collected so far."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, (*getattr(namespace, self.dest), values))


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

    GemsError -> ``prog: error: <message>`` on stderr and status 2; Ctrl-C -> status 130; a
    closed stdout (a pipe whose reader left) -> status 141, quietly.
    """
    try:
        status = body()
    except GemsError as error:
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # the reader left (`gems-plan ... | head`): stop quietly, as a killed writer would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nothing left to flush at exit
        return 128 + signal.SIGPIPE
    return 0 if status is None else int(status)


def communicator(prog: str, backend: str, timeout: float, allow_shared_gpu: bool):
    """This process's ``gems.comm.create(backend, ...)`` for a command run by every rank. A
    GemsError from it (a device placement that cannot work is raised alike on every rank) is
    printed once, by world rank 0, and every rank exits with status 2."""
    from gems import comm as comm_lib  # noqa: PLC0415 - MPI starts only for a real run

    try:
        return comm_lib.create(backend, timeout=timeout, allow_shared_gpu=allow_shared_gpu)
    except GemsError as error:
        if comm_lib.world_rank() == 0:
            print(f"{prog}: error: {one_line(error)}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR)


def setup_on_every_rank(prog: str, comm, setup: Callable[[], object]) -> object:
    """Run ``setup`` (which must not communicate) on every rank, then agree on the outcome:
    if it raised GemsError on any rank, rank 0 prints the first message once (naming the rank
    when not all failed) and every rank exits with status 2; otherwise return its result."""
    try:
        result, error = setup(), None
    except GemsError as e:
        result, error = None, str(e)
    failed = [(rank, e) for rank, e in enumerate(comm.allgather_object(error)) if e is not None]
    if failed:
        if comm.rank == 0:
            rank, message = failed[0]
            where = "" if len(failed) == comm.size else f" (rank {rank})"
            print(f"{prog}: error{where}: {one_line(message)}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR)
    return result
