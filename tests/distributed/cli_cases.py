"""Runs one CLI's ``main`` on many command lines in this one process (an MPI singleton), so a
test of bad input pays for one interpreter and one torch import instead of one per case.

    python cli_cases.py gems.cli.train '[["--model", "x", ...], ...]'

Prints a JSON list: per command line, the exit status ``main`` ended with and what it wrote to
stdout and stderr. Anything other than SystemExit escaping ``main`` is reported as status "raised"
with its traceback, which the test then shows. The command lines run in order, so one may use what
an earlier one wrote (a checkpoint, a plan file).
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import traceback


def main() -> None:
    cli = importlib.import_module(sys.argv[1])
    results = []
    for argv in json.loads(sys.argv[2]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                cli.main(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 -- reported to the test, which fails on it
                code, _ = "raised", err.write(traceback.format_exc())
        results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
