"""The `torchplace` command: parse, call the library, render. Nothing else lives here.

Each subcommand is a module in this package with `register(subparsers)`; heavy imports
(torch above all) happen inside the command, not at parse time, so `doctor` and `map` stay fast.

`main` is the one place where failures end (issue 14, item 7):
- a TorchplaceError, a usage error or an OSError (a path that cannot be read or written):
  one line, "torchplace: error: ...", with the fix (and "did you mean" for a misspelt command
  or option); exit 2;
- stdout closed by its reader (`torchplace doctor | head -1`): quiet, exit 0 (the reader had
  what it wanted; not an error), stdout pointed at /dev/null as Python's documentation advises
  for SIGPIPE; stdout closed before the start (`>&-`): one line saying so at the first output, exit 1;
- anything else is a bug in torchplace: one line naming the exception and how to see the
  traceback (TORCHPLACE_DEBUG=1, which prints it); exit 70 (EX_SOFTWARE).
Arguments are checked when they are parsed (`cli.args`), so most of these never get that far.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .args import UsageError
from .options import visible

# subcommand -> module; each module defines register(subparsers) -> None
COMMANDS: dict[str, str] = {
    "doctor": "torchplace.cli.doctor",
    "map": "torchplace.cli.map",
    "pick": "torchplace.cli.pick",
    "leases": "torchplace.cli.leases",
    "queue": "torchplace.cli.queue",
    "run": "torchplace.cli.run",
    "ckpt": "torchplace.cli.ckpt",
    "bench": "torchplace.cli.bench",
}
EXIT_USAGE, EXIT_PIPE, EXIT_NO_STDOUT, EXIT_BUG = 2, 0, 1, 70  # EXIT_PIPE: the reader had what it wanted
MAX_MESSAGE = 1200  # characters of one error line


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors that name the help to read."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"torchplace: error: {message.rstrip('.')}{_suggestion(message) or '.'} "
                         f"See `{self.prog} --help`.")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that subcommand is imported (keeps `pick` under 100 ms)."""
    from .._version import __version__

    parser = _Parser(prog="torchplace", description="Know where every tensor lives.")
    parser.add_argument("--version", action="version", version=f"torchplace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for module in wanted:
        importlib.import_module(module).register(sub)
    _check_types(parser)
    return parser


# options whose values are checked by name, wherever a subcommand (or a bench module) declares them
_POSITIVE_INTS = {"repeat", "repeats", "steps", "rounds", "tensors", "batches", "epochs", "batch", "processes",
                  "gpus", "size_mib", "nproc"}
_PATHS = {"snapshot", "dir", "plot", "file", "src", "dst"}


def _check_types(parser: argparse.ArgumentParser) -> None:
    """Give every option an ASCII-only, range-checked type (argparse's int() takes '²' and '-5')."""
    from . import args as t

    by_dest: dict[str, Any] = {"count": t.count_or_auto, "min_free_memory": t.size, "wait": t.duration,
                               "shape": t.shape, "sizes": t.sizes, "gpus": t.gpus, "tr_master_port": t.port,
                               "tr_node_rank": t.whole_number_text, "tr_max_restarts": t.whole_number_text,
                               "out": t.out_dir}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(p): p for p in action.choices.values()}.values():
                _check_types(sub)
            continue
        if not isinstance(action, argparse._StoreAction):
            continue
        dest = action.dest
        if action.type is int and dest == "max_utilization":
            action.type = t.percent
        elif action.type is int:
            action.type = t.whole_number(1 if dest in _POSITIVE_INTS else 0, t.C_INT_MAX)
        elif action.type is float:
            action.type = t.number(0.0, above=dest == "seconds")
        elif action.type is None and action.nargs is None:
            action.type = t.path if dest in _PATHS else by_dest.get(dest)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; every failure ends here as one line and an exit code (see the module doc)."""
    from ..errors import TorchplaceError

    if sys.stdout is None:  # started with descriptor 1 closed (`>&-`): Python leaves sys.stdout None
        sys.stdout = _ClosedStdout()
    interrupted, restore = _note_interrupts()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warn  # a library's warning: one line, not two with source
            code = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
        return code
    except (TorchplaceError, UsageError) as exc:
        _say(exc if isinstance(exc, UsageError) else f"torchplace: error: {exc}")
        return EXIT_USAGE
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_PIPE
    except _StdoutClosed:
        _say("torchplace: error: standard output is closed (the shell's >&-), so the output has nowhere to go. "
             "Fix: redirect it to a file or to /dev/null instead of closing it.")
        return EXIT_NO_STDOUT
    except OSError as exc:  # the system's answer about a path the user gave: not a bug
        where = f": {exc.filename!r}" if exc.filename else ""
        where += f" -> {exc.filename2!r}" if getattr(exc, "filename2", None) else ""
        _say(f"torchplace: error: {exc.strerror or exc}{where}. Fix: check the path and its permissions.")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if interrupted:  # Ctrl-C inside a library's C++ (torch's zip writer) comes out as its own error
            return 130
        if _debug():
            import traceback

            traceback.print_exc()
        _say(f"torchplace: internal error (a bug in torchplace): {type(exc).__name__}: {exc}. "
             + ("The traceback is above; please report it."
                if _debug() else "Rerun with TORCHPLACE_DEBUG=1 to see the traceback, and please report it."))
        return EXIT_BUG
    finally:
        restore()


def _note_interrupts() -> tuple[list[int], Callable[[], None]]:
    """(a list that gets an entry at each Ctrl-C, the call that puts Python's own handler back); SIGINT still
    raises KeyboardInterrupt as usual."""
    import signal

    seen: list[int] = []

    def on_sigint(signum: int, frame: Any) -> None:
        seen.append(signum)
        signal.default_int_handler(signum, frame)

    def restore() -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, on_sigint)
            return seen, restore
    except ValueError:  # not the main thread: interrupts are not ours to note
        pass
    return seen, lambda: None


class _StdoutClosed(Exception):
    """Something was printed while the program runs with stdout closed."""


class _ClosedStdout(io.TextIOBase):
    """sys.stdout of a program started with stdout closed: output raises _StdoutClosed, silence passes."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:
            raise _StdoutClosed
        return 0


def _main(argv: list[str]) -> int:
    from .. import _startup_error  # a bad TORCHPLACE_STRICT, found while `import torchplace` ran

    if _startup_error is not None:
        raise _startup_error
    parser = build_parser(argv[0] if argv else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help and --version end here, after printing
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
        raise _unknown_option(_dash_value(exc, argv), argv, parser) from None
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return int(args.func(args) or 0)


def _dash_value(exc: UsageError, argv: list[str]) -> UsageError:
    """argparse reads a value that starts with '-' ('--min-free-memory -5MB') as the next option and
    says only "expected one argument": name the value it skipped and the spelling that passes it."""
    found = re.search(r"argument (\S+?): expected one argument", str(exc))
    if not found:
        return exc
    names = found.group(1).split("/")
    for i, word in enumerate(argv[:-1]):
        value = argv[i + 1]
        if word in names and value.startswith("-") and value != "--":
            head, _, tail = str(exc).partition(". See `")
            return UsageError(f"{head}: {value!r} after {word} starts with '-', so it was read as an option, not "
                              f"as the value. Fix: write {word}={value} to pass it as the value (no option takes a "
                              f"negative number). See `{tail}")
    return exc


def _suggestion(message: str) -> str:
    """'; did you mean 'doctor'?' for argparse's "invalid choice: 'dcotor' (choose from ...)"."""
    import difflib

    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if not found:
        return ""
    close = difflib.get_close_matches(found.group(1), re.findall(r"'([^']*)'", found.group(2)), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unknown_option(exc: UsageError, argv: list[str], parser: argparse.ArgumentParser) -> UsageError:
    """Add "did you mean '--json'?" to argparse's "unrecognized arguments: --jsn", from the options of the
    (sub)commands named in ARGV (the top parser reports it, without knowing the subcommand's options)."""
    import difflib

    found = re.search(r"unrecognized arguments: (\S+)", str(exc))
    if not found or not found.group(1).startswith("-"):
        return exc
    options: list[str] = []
    current: argparse.ArgumentParser | None = parser
    words = iter(argv)
    while current is not None:
        options += [o for action in current._actions for o in action.option_strings]
        deepest = current
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        current = next((subs[0].choices[w] for w in words if subs and w in subs[0].choices), None)
    close = difflib.get_close_matches(found.group(1).split("=")[0], options, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return UsageError(f"{str(exc).partition('. See `')[0]}{hint} See `{deepest.prog} --help`.")


def _say(message: object) -> None:
    """One line on stderr, however long or multi-line the message; control characters escaped."""
    text = visible(" ".join(str(message).split()))
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE - 40] + f"... ({len(text)} characters in all)"
    try:
        if sys.stderr is not None:  # None when started with stderr closed (print would go to stdout)
            print(text, file=sys.stderr)
    except (OSError, ValueError):  # stderr closed too: nothing more to say
        pass


def _warn(message: Warning | str, category: type[Warning], filename: str, lineno: int,
          file: Any = None, line: str | None = None) -> None:
    _say(f"torchplace: warning: {category.__name__}: {message}")


def _stdout_to_devnull() -> None:
    """After EPIPE, point stdout at /dev/null so the flush at exit cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a captured stdout has no descriptor
        pass


def _debug() -> bool:
    return os.environ.get("TORCHPLACE_DEBUG", "").strip() not in ("", "0")
