"""The suite's commands, each a fork of a Python that has imported torch, transformers and the package already.

A command the tests run (``finetune/train.py``, ``python -m finetune.cli sweep``, ``tests/interrupt_worker.py``,
under ``accelerate launch`` or not) spends most of its time importing torch, transformers and the package, about
ten seconds on two cores, to train a tiny model for one or two. Here those imports happen once per test worker, in
multiprocessing's fork server, and each command is a fork of that server. It is still a process of its own, as a
user's command is: its own pid, environment, working directory, standard streams, signals and exit status, and
what a test's worker script patches is patched in it alone. A single-process ``accelerate launch`` is Accelerate's
own launcher, run in the fork, whose one child is a fork of it in turn; a launch of several processes
(``--multi_gpu``: torchrun's agent) likewise, each worker a fork of the launcher in a session of its own, as
torchrun starts them.

A fork is not a fresh interpreter, though. A command whose environment differs in a variable that a module may
read when it is imported (``HF_DATASETS_CACHE``, ``CXX``, ...) runs as a real subprocess, as does any command
that is not Python's, and every command on a machine with CUDA: :func:`forkable` decides. The tests of what a
command imports, or of how long it takes to start, start real processes themselves.

Written by hand: pytest-xdist and pytest-forked fork tests, not the commands a test runs.
"""

from __future__ import annotations

import atexit
import gc
import io
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent

# what the commands import: made once, in the server (a module that fails to import is passed over there)
PRELOAD = [
    "torch", "transformers", "datasets", "accelerate", "accelerate.commands.launch", "evaluate", "peft",
    "optuna", "sklearn.metrics", "safetensors.torch", "transformers.models.bert.modeling_bert",
    "finetune.assembly", "finetune.fitting", "finetune.launch", "finetune.sweep_trial", "finetune.evaluation",
    "finetune.plot", "matplotlib.figure", "matplotlib.backends.backend_agg",  # a run's curves.png at its end
    "torch.distributed.run",  # accelerate launch --multi_gpu: torchrun's agent
]

# variables read when they are used, not when a module is imported: a command may differ from the server in these
RUN_TIME_PREFIXES = ("FINETUNE_", "ACCELERATE_", "PYTEST_")
# the trackers' own variables, read by trackers the server never imports (a fork imports them under its own
# environment); test_forked checks that the server has imported none of them
UNIMPORTED_TRACKERS = {"WANDB_": "wandb", "MLFLOW_": "mlflow", "TRACKIO_": "trackio"}
RUN_TIME_KEYS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "PYTHONPATH", "COLUMNS", "LINES",
                 "CUDA_VISIBLE_DEVICES",  # only a machine without CUDA forks, and there it changes nothing
                 "TORCHINDUCTOR_CACHE_DIR",  # read as inductor compiles; its first compile sets it in the process
                 # sklearn (and threadpoolctl) set it as they are imported, in the server as in a fresh process;
                 # a test process has it only once it has imported them
                 "KMP_DUPLICATE_LIB_OK"}

_server: dict[str, object] = {}


def _context():
    """The fork server's context, started once per test process with ``base_env`` as its environment."""
    if not _server:
        from helpers import offline_env

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        base_env = offline_env()
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(base_env)  # the server inherits this environment, and imports under it
        try:
            process = context.Process(target=_nothing)
            process.start()
            process.join()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server.update(context=context, env=base_env)
    return _server["context"]


def _nothing() -> None:
    pass


def forkable(argv: Sequence[str], env: dict[str, str]) -> bool:
    """Whether ``argv`` can run as a fork of the server: Python's, in an environment whose differences from the
    server's are in variables read at run time."""
    if "forkserver" not in multiprocessing.get_all_start_methods():  # Windows
        return False
    if cuda():  # CUDA may not work in a fork of a process that asked for it (the server's imports may have)
        return False
    if len(argv) < 2 or argv[0] != sys.executable or (argv[1].startswith("-") and argv[1] not in ("-m", "-c")):
        return False
    _context()
    base = _server["env"]
    differing = {k for k in set(env) | set(base) if env.get(k) != base.get(k)}
    run_time = RUN_TIME_PREFIXES + tuple(UNIMPORTED_TRACKERS)
    return all(k.startswith(run_time) or k in RUN_TIME_KEYS for k in differing)


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class _Signalled:
    """What :class:`subprocess.Popen` does with signals, for a process with a ``pid`` and a ``poll``."""

    pid: int

    def poll(self) -> Optional[int]:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forked(_Signalled):
    """A forked command, as much of :class:`subprocess.Popen` as the tests use: ``pid``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``, ``communicate`` and ``returncode``."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Path, stdin: Optional[str] = None,
                 merge_stderr: bool = False, start_new_session: bool = False):
        self.args = list(argv)
        self._folder = Path(tempfile.mkdtemp(prefix="forked-"))
        self._streams = [self._folder / name for name in ("stdin", "stdout", "stdout" if merge_stderr else "stderr")]
        for path, text in zip(self._streams, (stdin or "", "", "")):
            path.write_text(text, encoding="utf-8")
        self._process = _context().Process(target=_command, args=(
            list(argv), dict(env), str(cwd), [str(p) for p in self._streams], start_new_session))
        self._process.start()
        self.pid = self._process.pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, Optional[str]]:
        """Wait for the command; its stdout and stderr (None with stderr merged into stdout), as text."""
        self.wait(timeout)
        out, err = (p.read_text(encoding="utf-8", errors="replace") for p in self._streams[1:])
        return out, (None if self._streams[2] == self._streams[1] else err)

    def __del__(self):
        shutil.rmtree(self._folder, ignore_errors=True)


def run(argv: Sequence[str], env: dict[str, str], cwd: Path = REPO, timeout: Optional[float] = None,
        input: Optional[str] = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, ...)``, forked where :func:`forkable` allows."""
    if not forkable(argv, env):
        return subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              input=input)
    command = Forked(argv, env, cwd, stdin=input)
    try:
        out, err = command.communicate(timeout)
    except subprocess.TimeoutExpired:
        command.kill()
        command.wait()
        raise
    return subprocess.CompletedProcess(list(argv), command.returncode, out, err)


def start(argv: Sequence[str], env: dict[str, str], cwd: Path = REPO, merge_stderr: bool = False,
          start_new_session: bool = False):
    """``subprocess.Popen(argv, stdout=PIPE, stderr=PIPE or STDOUT, text=True, start_new_session=...)``, forked
    where it can be. Read its output with ``communicate``; in a session of its own, ``os.killpg(pid, ...)``
    signals it and every process it started."""
    if not forkable(argv, env):
        return subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                                start_new_session=start_new_session)
    return Forked(argv, env, cwd, merge_stderr=merge_stderr, start_new_session=start_new_session)


# --------------------------------------------------------------------------- in the fork

def _command(argv: list[str], env: dict[str, str], cwd: str, streams: list[str], start_new_session: bool) -> None:
    """The forked process: become the command ``argv`` would have started, run it, and exit as it would."""
    for fd, path in enumerate(streams):
        target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    _become(env, cwd, start_new_session)
    # a launcher's children (accelerate launch's one process, torchrun's workers) are forks of this process in
    # turn; torchrun's agent holds Popen in its own module, under its own name
    subprocess.Popen = _launched_popen
    if ELASTIC_HANDLER in sys.modules:
        sys.modules[ELASTIC_HANDLER].Popen = _launched_popen
    os._exit(_run_as_main(argv[1:], env))


def _become(env: dict[str, str], cwd: Optional[str], start_new_session: bool) -> None:
    """The command's session, environment and working directory, and the random state a fresh interpreter would
    have."""
    if start_new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    # Python's random module reseeds itself in a fork; numpy's global generator would be the server's in every fork
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # what the server imported lives as long as the fork: a full collection (a run makes one before it
    # allocates, a sweep one after each trial) need not walk its half a million objects, half a second each time
    gc.freeze()


def _run_as_main(args: list[str], env: dict[str, str]) -> int:
    """``python ARGS`` (a script, ``-m module`` or ``-c code``, then its arguments) in this process; its exit
    status."""
    installed = [p for p in sys.path if p.startswith((sys.prefix, sys.base_prefix, sys.exec_prefix))]
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    option, rest = (args[0], args[1:]) if args[0] in ("-m", "-c") else (None, args)
    # what Python puts first on the path: the script's folder; for -m, the working directory; for -c, ''
    first = {None: str(Path(rest[0]).resolve().parent), "-m": os.getcwd(), "-c": ""}[option]
    sys.path[:] = [first, *pythonpath, *installed]
    sys.argv = ["-c" if option == "-c" else rest[0], *rest[1:]]
    interrupted = False
    try:
        if option is None:
            runpy.run_path(rest[0], run_name="__main__")
        elif option == "-m":
            sys.modules.pop(rest[0], None)  # as in a fresh process, where -m runs a module not yet imported
            runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
        else:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(rest[0], "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except BaseException as error:
        sys.excepthook(*sys.exc_info())
        interrupted, code = isinstance(error, KeyboardInterrupt), 1
    # the interpreter's exit runs these; the os._exit that ends a fork would not (no public way to run them)
    atexit._run_exitfuncs()
    _flush()
    if interrupted:  # Python ends an unhandled ^C, after its exit, by that signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


_RealPopen = subprocess.Popen


ELASTIC_HANDLER = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"


def _launched_popen(args, *rest, env=None, cwd=None, stdout=None, stderr=None, start_new_session=False, **kwargs):
    """``Popen`` in a forked command: a Python child that inherits the streams, or whose stderr the launcher
    reads through a pipe, as a launcher starts one (``python -u script ...`` in a session of its own from
    torchrun's agent; ``python script ...`` with ``stderr=PIPE`` from Accelerate's, which copies what the child
    writes there through to its own as it comes and keeps its tail), is a fork of this process; any other child is
    a real one."""
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else []
    unbuffered = argv[1:2] == ["-u"]
    if unbuffered:
        argv = [argv[0], *argv[2:]]
    if (rest or kwargs or stdout is not None or stderr not in (None, subprocess.PIPE)
            or argv[:1] != [sys.executable] or len(argv) < 2):
        return _RealPopen(args, *rest, env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                          start_new_session=start_new_session, **kwargs)
    return _ForkedChild(argv, env or dict(os.environ), cwd, start_new_session, unbuffered,
                        stderr_piped=stderr == subprocess.PIPE)


class _ForkedChild(_Signalled):
    """The child a launcher starts, forked from the launcher's process: ``wait``, ``poll`` and ``returncode``."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Optional[str], start_new_session: bool,
                 unbuffered: bool, stderr_piped: bool = False):
        self.args = argv
        self.returncode: Optional[int] = None
        self.stdout = self.stdin = self.stderr = None
        _flush()  # else what the launcher has buffered would be written twice
        read_end, write_end = os.pipe() if stderr_piped else (None, None)
        self.pid = os.fork()
        if self.pid == 0:
            if stderr_piped:  # the child's fd 2 is the pipe's write end, as Popen(stderr=PIPE) makes it
                os.dup2(write_end, 2)
                os.close(write_end)
                os.close(read_end)
            if unbuffered:  # python -u: each write goes to the file as it is made
                sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                                           encoding=stream.encoding, errors=stream.errors)
                                          for fd, stream in ((1, sys.stdout), (2, sys.stderr)))
            _become(env, cwd, start_new_session)
            os._exit(_run_as_main(argv[1:], env))
        if stderr_piped:
            os.close(write_end)
            self.stderr = open(read_end, "rb")  # buffered: read1, as the launcher reads a Popen's pipe

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def communicate(self, input=None, timeout: Optional[float] = None) -> tuple[None, None]:
        self.wait(timeout)
        return None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.wait()
