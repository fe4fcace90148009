"""`python -m gpu_worker`, with a direct socket that queues $DIRECT_SNDHWM replies per
connection instead of `DirectSocket.sndhwm` (10,000), for the tests that fill a client's
queue with a few large replies (tests/e2e/test_direct_full.py).  Run as a script, with the
worker's own arguments."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gpu_worker import leases  # noqa: E402
from gpu_worker.__main__ import main  # noqa: E402

leases.DirectSocket.sndhwm = int(os.environ["DIRECT_SNDHWM"])
sys.exit(main())
