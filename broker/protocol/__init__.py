"""The wire protocol, as a leaf package: every process imports it, and it imports nothing of
the project but `shm`.

- `frames`: every MDP/0.2 command, built and parsed, and MDP/0.1's read and written (the frame tables are data there);
- `header`: the msgpack header frames, their schema, decoding and validation;
- `refs`: `ShmLoc`/`CudaLoc` on the wire <-> `shm.ShmRef`/`shm.cuda.DeviceRef`;
- `naming`: host identity, runtime directory, default endpoints, reply-socket files;
- `wire`: multipart send/receive for the hot paths.

`from broker import protocol as P` gives the public names of all but `wire` (`P.ShmLoc`,
`P.parse_client`, `P.shm_ref`, `P.local_host_id`, ...).  `broker/__init__.py` imports nothing, so importing this package never
loads the broker process.  docs/protocol.md is the prose form, for implementers in other
languages.
"""
from __future__ import annotations

from .frames import *  # noqa: F401,F403
from .frames import __all__ as _frames_all
from .header import *  # noqa: F401,F403
from .header import __all__ as _header_all
from .naming import *  # noqa: F401,F403
from .naming import __all__ as _naming_all
from .ratelog import RateLimitedLog
from .refs import *  # noqa: F401,F403
from .refs import __all__ as _refs_all

__all__ = [*_header_all, *_frames_all, *_naming_all, *_refs_all, "RateLimitedLog"]
