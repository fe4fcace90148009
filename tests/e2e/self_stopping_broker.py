"""`python -m broker` that stops itself (SIGSTOP) at one chosen point of its loop: at the
start of its first timer run (`Broker._run_timers`, before the loop's wait) after the file
named by $BROKER_STOP_FILE appears, which it removes.  A SIGSTOP sent from outside lands
wherever the loop happens to be; this one lands between a pass's start and its wait, every
time (tests/e2e/test_paused_together.py).  Run as a script, with the broker's own arguments."""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from broker import server  # noqa: E402
from broker.__main__ import main  # noqa: E402

_STOP_FILE = os.environ["BROKER_STOP_FILE"]
_run_timers = server.Broker._run_timers


def _stopping_run_timers(self, now):
    try:
        os.unlink(_STOP_FILE)
    except FileNotFoundError:
        pass
    else:
        os.kill(os.getpid(), signal.SIGSTOP)  # continued by the test
    return _run_timers(self, now)


server.Broker._run_timers = _stopping_run_timers
sys.exit(main())
