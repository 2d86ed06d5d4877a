"""The commands (``python -m glmvit COMMAND``) and the explorer app: the tool layer over the library.

Nothing in the library imports from here. Every command shares :mod:`glmvit.cli.common` for the device / config /
dtype policy, model building, JSON output with provenance, and one-line errors.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import signal
import sys
import threading
import time
import warnings
from typing import Iterator, TextIO

COMMANDS = {
    "demo": ("glmvit.cli.demo", "encode the sample images and clip with the embedded default model"),
    "encode": ("glmvit.cli.encode", "encode image/video files and print (or save) their embeddings"),
    "plan": ("glmvit.cli.plan", "pack a workload into token budgets and print the plan statistics"),
    "bench": ("glmvit.cli.bench", "benchmark transformers vs eager vs CUDA graphs vs the GPU's floor"),
    "latency": ("glmvit.cli.latency", "measure the latency table (every budget, several layouts) for the cost model"),
    "kernels": ("glmvit.cli.kernels", "profile a graph replay kernel by kernel against each op's roofline (CUDA)"),
    "ncu": ("glmvit.cli.ncu", "what limits each kernel of a graph replay, from Nsight Compute's counters (CUDA)"),
    "bench-interp": ("glmvit.cli.bench_interp", "benchmark the Triton interpolation kernel vs grid_sample"),
    "dp-bench": ("glmvit.cli.dp_bench", "data-parallel demo/benchmark (launch with torchrun -m glmvit.cli.dp_bench)"),
    "serve": ("glmvit.cli.serve", "serve the encoder over HTTP, batching the items of concurrent requests"),
    "bench-serve": ("glmvit.cli.bench_serve", "load-test a server (or one it starts) as vllm bench serve does"),
    "record": ("glmvit.cli.record", "re-measure every recorded GPU result at this code, in one run (CUDA)"),
    "records": ("glmvit.cli.records", "list the recorded results and which are stale (code changed since)"),
}
OUTPUT_FLAGS = ("--out", "--json", "--export")  # the commands' output files: "-" or /dev/stdout is standard output
USER_ERRORS = (ValueError, OSError)  # bad input or files: one line, no traceback (GLMVIT_DEBUG=1 shows it)


CTRL_C = threading.Event()  # set by the SIGINT handler main() installs: what a C extension cannot hide


def _on_sigint(signum: int, frame: object) -> None:
    """Python's default SIGINT handler, remembered."""
    CTRL_C.set()
    raise KeyboardInterrupt


PROMPT_EXIT_COMMANDS = ("demo", "encode", "plan", "bench", "latency", "kernels", "ncu", "bench-interp")  # no
# server, no recorder, no torchrun ranks: those shut down their own way
CTRL_C_GRACE_S = 2.0  # how long the main thread has to stop after Ctrl-C before the process is ended for it


def _exit_promptly_on_ctrl_c(command: str) -> None:
    """Make Ctrl-C stop ``command`` within CTRL_C_GRACE_S even while the main thread is inside one long C call (a
    torch op of minutes), where Python cannot run its SIGINT handler until the call returns: the signal's C handler
    also writes to a pipe (``signal.set_wakeup_fd``), and a thread waiting on it ends the process (one line,
    status 130) if the main thread has not stopped within the grace. Outputs are written atomically, so an output
    is either whole or absent. Only for the process's own command, from the main thread."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):  # not the main thread, or not allowed here: Python's handler alone then
        os.close(read_fd)
        os.close(write_fd)
        return

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGINT in data:
                time.sleep(CTRL_C_GRACE_S)  # the main thread's own handling (one line, os._exit) comes first
                print(f"glmvit {command}: interrupted", file=sys.stderr, flush=True)
                os._exit(130)

    threading.Thread(target=watch, name="glmvit-ctrl-c", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        parser = argparse.ArgumentParser(prog="python -m glmvit")
        parser.add_argument("command", choices=list(COMMANDS),
                            help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
        parser.parse_args(argv[:1])
        return 2
    if argv[0] not in COMMANDS:
        print(f"python -m glmvit: error: unknown command {one_line(argv[0])}; the commands: {', '.join(COMMANDS)} "
              "(see --help)", file=sys.stderr)
        return 2
    CTRL_C.clear()
    own = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if own:
        signal.signal(signal.SIGINT, _on_sigint)
        if argv[0] in PROMPT_EXIT_COMMANDS and _own_process():
            _exit_promptly_on_ctrl_c(argv[0])
    try:
        return _dispatch(argv)
    finally:
        if own:  # an in-process caller gets Python's handler back
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _dispatch(argv: list[str]) -> int:
    try:  # the imports too: torch's takes seconds, and Ctrl-C often lands there. numpy first: torch's C extension
        # imports it itself and carries on past a KeyboardInterrupt, leaving numpy half-loaded and the Ctrl-C lost
        importlib.import_module("numpy")
        with _lines_only(), _status_stream(argv[1:]), warnings.catch_warnings():
            # PIL's warnings while it parses a corrupt EXIF block: the picture still decodes (its orientation
            # tag, if unreadable, is left unapplied), so they are noise in a command's output and a server's log
            warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.TiffImagePlugin")
            return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:]) or 0
    except KeyboardInterrupt:
        if os.environ.get("GLMVIT_DEBUG"):
            raise
        return _interrupted(argv[0])
    except Exception as err:
        if os.environ.get("GLMVIT_DEBUG"):
            raise
        if CTRL_C.is_set():  # a C extension turned the KeyboardInterrupt into its own error (numpy: ImportError)
            return _interrupted(argv[0])
        if not isinstance(err, USER_ERRORS):
            raise
        print(f"glmvit {argv[0]}: error: {one_line(str(err))}", file=sys.stderr)
        return 1


def one_line(text: str) -> str:
    """``text`` on one line: a line break or other control character (a file name may hold one) written as its
    escape (``\\n``), so that an error stays one line whatever it names."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


class LineStream(io.TextIOBase):
    """A text stream over ``stream`` that writes whole lines only: a carriage return (a progress bar redrawing
    itself) discards what came since the last line break, so a bar reaches a log or a pipe once, as its final
    state, instead of as one redraw per update."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.stream.write(line.rsplit("\r", 1)[-1] + "\n")
        self.pending = self.pending.rsplit("\r", 1)[-1]
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def finish(self) -> None:
        """Write what is left of an unfinished line (without a carriage return before it) and flush."""
        if self.pending:
            self.stream.write(self.pending + "\n")
            self.pending = ""
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


@contextlib.contextmanager
def _lines_only() -> Iterator[None]:
    """Standard error as a :class:`LineStream` while it is not a terminal (a log, a pipe): progress bars then add
    lines, not carriage-return redraws."""
    stream = sys.stderr
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # None (standard error closed), or a closed stream: left as it is
        terminal = True
    if terminal or isinstance(stream, LineStream) or "ipykernel" in sys.modules:
        yield
        return
    lines = LineStream(stream)
    sys.stderr = lines
    try:
        yield
    finally:
        if sys.stderr is lines:
            sys.stderr = stream
        lines.finish()


def _status_stream(args: list[str]) -> contextlib.AbstractContextManager:
    """Status text (``print``) goes to stderr while an output file of ``args`` is standard output, so that the
    output holds nothing else."""
    from ..files import is_stdout

    values = [b for a, b in zip(args, args[1:], strict=False) if a in OUTPUT_FLAGS]
    values += [a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in OUTPUT_FLAGS and "=" in a]
    if any(is_stdout(value) for value in values if value):
        return contextlib.redirect_stdout(sys.stderr)
    return contextlib.nullcontext()


def _interrupted(command: str) -> int:
    """Ctrl-C: one line and status 130 (outputs are written atomically at the end, so none is half-written). As the
    process's own command it exits at once: CPython re-raises SIGINT at shutdown (status −2) when the interrupt
    passed through code it ran with exec (a dataclass being made during torch's import), and a second Ctrl-C
    during the seconds torch takes to shut down would print a traceback."""
    print(f"glmvit {command}: interrupted", file=sys.stderr)
    if _own_process():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return 130


def _own_process() -> bool:
    """Whether the command is the process's own (``python -m glmvit``), not a call from other code."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(main_spec, "name", None) == "glmvit.__main__"
