"""The suite's forked commands (``tests/forked.py``) against the real processes they stand for.

The tests that run commands trust a fork to end, print and read as ``python ARGS`` would; each case here runs
the same command both ways and compares what a test can see: exit status, stdout, stderr, and what the program
saw of its arguments, environment, working directory, path and standard input.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forked
from helpers import offline_env

pytestmark = pytest.mark.skipif(forked.cuda(), reason="commands are not forked on a machine with CUDA")

# what a command sees of the process it runs in (no torch: the real process starts in a fraction of a second)
SEES = """\
import os, sys
print(sys.argv[1:], os.getcwd(), sys.path[0], os.environ.get("FINETUNE_SEEN"), repr(sys.stdin.read()))
print("to stderr", file=sys.stderr)
"""


def _both(argv: list[str], cwd: Path, env: dict[str, str], stdin: str = "") -> tuple:
    real = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, input=stdin, timeout=60)
    fork = forked.run(argv, env=env, cwd=cwd, input=stdin, timeout=60)
    return (real.returncode, real.stdout, real.stderr), (fork.returncode, fork.stdout, fork.stderr)


@pytest.fixture
def programs(tmp_path):
    (tmp_path / "bin").mkdir()  # a script's folder is not the working directory: each goes first on a path
    (tmp_path / "bin" / "sees.py").write_text(SEES + "sys.exit(3)\n", encoding="utf-8")
    (tmp_path / "sees_module.py").write_text(SEES, encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("form", ["script", "module", "code"])
def test_a_fork_sees_and_says_what_the_process_would(programs, form):
    argv = {"script": [sys.executable, str(programs / "bin" / "sees.py")],
            "module": [sys.executable, "-m", "sees_module"],
            "code": [sys.executable, "-c", SEES]}[form] + ["an argument", "--flag"]
    env = offline_env({"FINETUNE_SEEN": "yes"})
    assert forked.forkable(argv, env)
    real, fork = _both(argv, programs, env, stdin="a line\nanother\n")
    assert fork == real
    assert real[1].startswith("['an argument', '--flag']") and " yes " in real[1] and "'a line\\nanother\\n'" in real[1]


@pytest.mark.parametrize("ending", [
    "sys.exit('a message')",  # 1, the message on stderr
    "raise ValueError('boom')",  # 1, a traceback
    "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)",  # killed by the signal: -15
    "raise KeyboardInterrupt",  # Python ends by SIGINT: -2
    "import atexit; atexit.register(print, 'at exit')",  # the interpreter's exit handlers run
    "import atexit; atexit.register(print, 'at exit'); raise KeyboardInterrupt",  # before SIGINT ends it
])
def test_a_fork_ends_as_the_process_would(tmp_path, ending):
    code = f"import os, signal, sys, time\nprint('started', flush=True)\n{ending}\n"
    real, fork = _both([sys.executable, "-c", code], tmp_path, offline_env())
    assert fork[:2] == real[:2]
    # a traceback names the same lines, with the same last line
    assert fork[2].splitlines()[-1:] == real[2].splitlines()[-1:]


def test_a_launch_under_accelerate_exits_and_sees_the_environment_as_it_would(tmp_path):
    """A single-process ``accelerate launch`` is Accelerate's own launcher in the fork, and its child a fork of the
    launcher (it finds torch imported): its environment is the one the launcher sets, what it writes to stderr
    reaches the launcher's (which reads it through a pipe), and a failing child's status is the launcher's 1."""
    script = tmp_path / "launched.py"
    script.write_text("import os, sys\nprint(sorted((k, v) for k, v in os.environ.items() if k.startswith("
                      "('ACCELERATE_', 'LOCAL_RANK', 'RANK', 'WORLD_SIZE'))))\n"
                      "print('imported torch', 'torch' in sys.modules)\n"
                      "sys.stderr.write('the child says so on stderr\\n')\nsys.exit(2)\n", encoding="utf-8")
    argv = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    real, fork = _both(argv, tmp_path, offline_env())
    assert fork[0] == real[0] == 1
    assert "ACCELERATE_USE_CPU" in real[1] and real[1].endswith("imported torch False\n")
    assert fork[1] == real[1].replace("torch False", "torch True")  # the child was forked from the launcher
    assert "the child says so on stderr" in real[2] and "the child says so on stderr" in fork[2]


# what each rank of a torchrun launch says of its process, in one write (the ranks share the launcher's stdout, and
# print's pieces, unbuffered, would interleave); rank 1 then fails, once rank 0 has spoken (a file named by their
# launcher), and rank 0 waits to be stopped
RANK_SAYS = """\
import os, sys, time
seen = (f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} own session {os.getsid(0) == os.getpid()} "
        f"unbuffered {sys.stdout.write_through} imported torch {'torch' in sys.modules}")
sys.stdout.write(seen + "\\n")
spoken = f"rank-0-of-{os.getppid()}"
if os.environ["RANK"] == "0":
    open(spoken, "w").close()
    time.sleep(60)
deadline = time.monotonic() + 30
while not os.path.exists(spoken) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(3)
"""


def test_a_launch_of_two_processes_forks_each_worker_in_a_session_of_its_own_as_torchrun_starts_it(tmp_path):
    """``torchrun`` (what ``accelerate launch --multi_gpu`` runs) in the fork: each worker a fork of the launcher,
    with torchrun's environment, a session of its own (the agent stops a worker's whole group) and unbuffered
    streams (``python -u``); a failing rank stops the other and gives the launcher's status."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SAYS, encoding="utf-8")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
            "--monitor_interval", "0.1", str(script)]
    started = time.monotonic()
    real, fork = _both(argv, tmp_path, offline_env())
    assert time.monotonic() - started < 50  # rank 0 was stopped, not waited for
    assert fork[0] == real[0] == 1, (real[2][-2000:], fork[2][-2000:])
    lines = [sorted(out.splitlines()) for out in (real[1], fork[1])]
    assert lines[0] == [f"rank {r} of 2 own session True unbuffered True imported torch False" for r in (0, 1)]
    # the same, but for what shows each worker was forked from a launcher that had torch imported
    assert lines[1] == [line.replace("torch False", "torch True") for line in lines[0]]
    assert "rank.py FAILED" in real[2] and "rank.py FAILED" in fork[2]


def test_a_started_fork_takes_signals_and_merges_its_streams_as_popen_would(tmp_path):
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
            "print('ready', flush=True); print('waiting', file=sys.stderr, flush=True)\n"
            "open('ready', 'w').close()\n"
            "time.sleep(60)\n")
    argv = [sys.executable, "-c", code]
    outputs = []
    for how in ("real", "fork"):
        (tmp_path / how).mkdir()
        if how == "real":
            started = subprocess.Popen(argv, cwd=tmp_path / how, env=offline_env(), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
        else:
            started = forked.start(argv, env=offline_env(), cwd=tmp_path / how, merge_stderr=True)
        deadline = time.monotonic() + 60
        while not (tmp_path / how / "ready").exists():
            assert started.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        started.send_signal(signal.SIGTERM)
        outputs.append((started.communicate(timeout=60)[0], started.returncode))
    assert outputs[1] == outputs[0] == ("ready\nwaiting\n", 143)


def test_an_environment_read_at_import_is_a_real_process():
    argv = [sys.executable, "-c", "pass"]
    assert forked.forkable(argv, offline_env({"FINETUNE_CPU_THREADS": "2", "ACCELERATE_USE_CPU": "True"}))
    # set by a module the server imported (sklearn), in the test process only once it has imported it too
    with_it = offline_env({"KMP_DUPLICATE_LIB_OK": "True"})
    without_it = {k: v for k, v in with_it.items() if k != "KMP_DUPLICATE_LIB_OK"}
    assert forked.forkable(argv, with_it) and forked.forkable(argv, without_it)
    assert not forked.forkable(argv, offline_env({"HF_DATASETS_CACHE": "/elsewhere"}))
    assert not forked.forkable(argv, offline_env({"CXX": "no-such-c++"}))
    assert not forked.forkable([sys.executable, "-X", "importtime", "-c", "pass"], offline_env())
    assert not forked.forkable(["bash", "-c", "true"], offline_env())
    # a tracker's variables: the server imports no tracker, so a fork reads them as a fresh process would
    assert forked.forkable(argv, offline_env({"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": "sqlite:///x.db",
                                              "TRACKIO_DIR": "/elsewhere"}))


def test_the_server_imports_none_of_the_trackers_whose_variables_a_fork_may_change():
    # a fork holds the modules the server imported: it lists those of the trackers
    trackers = sorted(forked.UNIMPORTED_TRACKERS.values())
    listing = f"import sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(trackers)!r}))"
    argv = [sys.executable, "-c", listing]
    assert forked.forkable(argv, offline_env())
    proc = forked.run(argv, env=offline_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
