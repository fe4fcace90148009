"""pid 1 of a container: a small init in front of our process, as `docker run --init` (tini)
would put there.

The kernel treats pid 1 of a pid namespace apart, in two ways that matter to a broker, a
launcher or a worker run as a container's first process (Kubernetes runs a container's
command as its pid 1 unless the pod shares its pid namespace; Docker does without `--init`):

- a signal whose action is the default one is discarded: a worker still loading its model
  (SIGTERM and SIGINT at their default action there, docs/operations.md) went on loading
  through `docker stop` or a pod's deletion until the SIGKILL of the grace period's end;
- every orphan of the namespace (a model's subprocess whose parent exited, a worker's
  child left by its SIGKILL) becomes its child, and stays a zombie unless it reaps it: our
  processes reap only the children they started themselves.

So `python -m broker` and `python -m gpu_worker`, as pid 1, start the same command again as
their child (pid 2, in a process group of its own, made the terminal's foreground group
when there is a terminal), and become its init: a process that forwards every signal an
operator or a runtime sends (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM,
SIGWINCH, SIGTSTP, SIGCONT) to it, reaps every child that exits, and exits with its
status (128 + N for a program that a signal N ended) once it has exited.  The init is a
fresh interpreter (`python -S`: no site packages, only built-in modules imported), so it
holds none of the program's memory or threads.
Outside pid 1 nothing changes.

Must never: be called from the client SDK (a library does not restructure its host
process), or after the process has started anything (it starts the command again).
"""
from __future__ import annotations

import os
import signal
import sys

__all__ = ["FORWARDED", "become_init_if_pid1"]

#: the signals the init passes on to the program (the others either cannot be caught, are
#: the program's own faults, or are SIGCHLD, the init's)
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGWINCH, signal.SIGTSTP, signal.SIGCONT)

# The init's loop, run by a fresh `python -S -c` (no site: it imports only built-in modules;
# the environment kept, which a Python that needs PYTHONHOME to start needs) with the forwarded signals and SIGCHLD blocked since before the program
# was started, so none sent meanwhile is lost: they wait, pending, for sigwaitinfo.
_LOOP = r"""
import os, signal, sys

def init(child, forwarded):
    watched = set(forwarded) | {signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    while True:
        while True:  # reap every child that has exited: the program, and orphans given to us
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                os._exit(0)  # (no child at all: the program was reaped already; cannot happen)
            if pid == 0:
                break
            if pid == child:
                os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
        info = signal.sigwaitinfo(watched)
        if info.si_signo != signal.SIGCHLD:
            try:
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass
"""


def become_init_if_pid1() -> None:
    """As pid 1 on Linux: start this command again as a child and become its init (module
    docstring); this call then never returns.  Anywhere else (or when the child cannot be
    started: a line on stderr says why) it returns at once, and the caller runs as it is."""
    if os.getpid() != 1 or not sys.platform.startswith("linux"):
        return
    argv = list(getattr(sys, "orig_argv", ()))
    if not argv or not sys.executable:
        return
    watched = {*FORWARDED, signal.SIGCHLD}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        child = os.posix_spawn(sys.executable, argv, os.environ, setpgroup=0, setsigmask=mask)
    except OSError as e:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _say(f"{argv[0]}: running as pid 1 without an init: the command could not be started again under one "
             f"({e}); orphaned processes are not reaped and a default signal action does nothing")
        return
    try:  # a terminal's Ctrl-C and Ctrl-Z go to the program's group, not to us (and not twice)
        if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp():
            os.tcsetpgrp(0, child)
    except OSError:
        pass
    try:
        os.execv(sys.executable, [sys.executable, "-S", "-c", _LOOP + "\ninit(int(sys.argv[1]), "
                                  f"{[int(s) for s in FORWARDED]})\n", str(child)])
    except OSError:  # no interpreter to run the init in: the loop here, in this process
        ns: dict = {}
        exec(_LOOP, ns)  # noqa: S102 - our own text, above
        ns["init"](child, FORWARDED)


def _say(line: str) -> None:
    try:
        os.write(2, line.encode(errors="backslashreplace") + b"\n")
    except OSError:
        pass
