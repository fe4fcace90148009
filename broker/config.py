"""The deploy file: one TOML file for the broker and the worker pools it launches.

`python -m broker --config deploy.toml` reads it; `BrokerConfig.from_toml` takes the broker's
part (its keys at the top level, or under a `[broker]` table) and `load_launcher` the rest:
`[[pool]]` tables (the worker pools, docs/operations.md "One launcher") and an optional
`[launcher]` table.  Every key of the file belongs to one of them: an unknown key, or a value
of the wrong type or out of range, is a `ConfigError` whose message is one line naming the
file, the table and the key (`python -m broker` prints it and exits 2).

Socket-free and clock-free: this module only reads and checks data.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = [
    "ConfigError", "PROCESS_TABLES", "POOL_KEYS", "LAUNCHER_KEYS", "PoolConfig", "LauncherConfig",
    "read_toml", "check_broker_keys", "load_launcher", "launcher_from_data",
]

#: top-level tables that belong to the launcher, not to the broker loop
PROCESS_TABLES = ("pool", "launcher")

#: transports a worker may offer (broker.protocol's TRANSPORTS; repeated here as data so the
#: config layer needs no protocol import)
_TRANSPORTS = ("inline", "shm", "cuda")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class ConfigError(ValueError):
    """A deploy file that cannot be used; the message is one line naming the key."""


def read_toml(path: str) -> dict:
    """The file's tables, or a ConfigError saying why it cannot be read."""
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 (a byte-order mark is not allowed either)
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_like(where: str, key: str, value: Any, default: Any) -> None:
    """`value` must have the type of `default` (a dataclass field's default): an int for an
    int, a number for a float (or for an optional number, default None), a string, a bool, a
    list of numbers for a tuple, a table for a nested dataclass."""
    if dataclasses.is_dataclass(default):
        ok, want = isinstance(value, dict), "a table"
    elif isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float) or default is None:
        ok, want = _is_number(value), "a number"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    elif isinstance(default, (tuple, list)):
        ok, want = isinstance(value, list) and all(_is_number(x) for x in value), "a list of numbers"
    else:  # a type this checker does not know: the consumer checks it
        return
    if not ok:
        raise ConfigError(f"{where}{key} must be {want}, not {_show(value)}")


def _defaults(cls) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
        else:
            out[f.name] = None
    return out


def _unknown(where: str, key: str, known) -> ConfigError:
    return ConfigError(f"{where}unknown key {key!r} (known: {', '.join(sorted(known))})")


def check_broker_keys(data: Mapping[str, Any], path: str, broker_cls) -> None:
    """Every key of the file is the broker's (a field of `broker_cls`, BrokerConfig, at the top
    level or in `[broker]`), `broker`, or a launcher table; broker values have their field's
    type, and `[scheduler]` keys are fields of its dataclass with their types.  The
    `[security]` table checks itself (`SecurityConfig.from_table`)."""
    fields = _defaults(broker_cls)
    if "broker" in data:
        if not isinstance(data["broker"], dict):
            raise ConfigError(f"{path}: broker must be a table ([broker]), not {_show(data['broker'])}")
        for key in data:
            if key != "broker" and key not in PROCESS_TABLES:
                hint = " (with a [broker] table, the broker's keys go in it)" if key in fields else ""
                raise ConfigError(f"{path}: unknown top-level key {key!r}{hint} "
                                  f"(known: broker, {', '.join(PROCESS_TABLES)})")
        table, where = data["broker"], f"{path}: [broker] "
    else:
        table, where = {k: v for k, v in data.items() if k not in PROCESS_TABLES}, f"{path}: "
    for key, value in table.items():
        if key not in fields:
            raise _unknown(where, key, set(fields) | ({"broker", *PROCESS_TABLES} if where == f"{path}: " else set()))
        if key == "security":
            continue
        _check_like(where, key, value, fields[key])
        if key in ("frontend", "backend") and not value.strip():
            # Leave it out for the default: a templated `frontend = "$FE"` with FE unset bound
            # the default endpoint, where another broker of the user may serve (as the flag did).
            raise ConfigError(f"{where}{key} is empty (leave it out for the default endpoint)")
        if key == "scheduler":
            sched = _defaults(type(fields[key]))
            for k, v in value.items():
                if k not in sched:
                    raise _unknown(f"{where}[scheduler] ", k, sched)
                _check_like(f"{where}[scheduler] ", k, v, sched[k])


# ------------------------------------------------------------------------------ pools


@dataclass(frozen=True)
class PoolConfig:
    """One `[[pool]]` table: `count` workers of one model, all with the same options.  An
    option left out (None) is left to `python -m gpu_worker`'s own default."""

    name: str
    model: str
    count: int = 1
    device: str | None = None
    service: str | None = None
    max_batch: int | None = None
    max_delay_ms: float | None = None
    max_cost: float | None = None
    credit: int | None = None
    transports: tuple[str, ...] | None = None
    keep_warm_ms: float | None = None
    drain_grace_s: float | None = None
    lifo_after_ms: float | None = None
    extra_args: tuple[str, ...] = ()

    @property
    def grace(self) -> float:
        """The drain grace its workers get: the `drain_grace_s` key, else a `--drain-grace-s`
        in extra_args (the last one, as the worker's parser takes it), else the worker's
        default, 30 s.  The launcher's default stop timeout follows it: it read the key only,
        and SIGKILLed a worker given a longer grace in extra_args 40 s after its SIGTERM."""
        if self.drain_grace_s is not None:
            return float(self.drain_grace_s)
        for value in reversed(_flag_values(self.extra_args, "--drain-grace-s")):
            try:
                v = float(value)
            except ValueError:
                break  # the worker refuses it and says so
            if 0 <= v <= _LONGEST_S:
                return v
            break
        return 30.0

    def worker_args(self, backend: str, *, heartbeat_interval: float | None = None,
                    heartbeat_liveness: int | None = None, link: tuple[str, ...] = ()) -> list[str]:
        """`python -m gpu_worker` arguments for one worker of this pool (after `-m gpu_worker`).
        `link`: flags for the broker connection (`--insecure`, `--server-key KEY` on tcp);
        `extra_args` come last, so they override anything before them."""
        # Each flag and its value one word (`--flag=value`): as two, a value that starts with
        # "-" (lifo_after_ms = -1e20, a model or service named "-fast") was taken by the
        # worker's parser for a flag, and the worker exited 2 ("expected one argument").
        a = [f"--broker={backend}", f"--model={self.model}"]
        if heartbeat_interval is not None:
            a.append(f"--heartbeat-interval={float(heartbeat_interval)!r}")
        if heartbeat_liveness is not None:
            a.append(f"--heartbeat-liveness={int(heartbeat_liveness)}")
        for key, flag in _FLAGS:
            v = getattr(self, key)
            if v is None:
                continue
            a.append(f"{flag}=" + (",".join(v) if key == "transports" else (repr(float(v)) if isinstance(v, float)
                                                                          else str(v))))
        return a + list(link) + list(self.extra_args)


#: pool key -> the gpu_worker flag it becomes (name, model, count and extra_args are the launcher's)
_FLAGS = (
    ("service", "--service"), ("device", "--device"), ("max_batch", "--max-batch"),
    ("max_delay_ms", "--max-delay-ms"), ("max_cost", "--max-cost"), ("credit", "--credit"),
    ("transports", "--transports"), ("keep_warm_ms", "--keep-warm-ms"), ("drain_grace_s", "--drain-grace-s"),
    ("lifo_after_ms", "--lifo-after-ms"),
)


def _name(v):
    return isinstance(v, str) and v.strip() == v and v != "" and not any(c.isspace() for c in v)


def _int_between(lo, hi):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi), f"an integer from {lo} to {hi}"


#: the longest time a deploy file may set (about eleven days): longer ones overflowed the
#: launcher's waits and stopped it (found by the command-line hunt)
_LONGEST_S = 1e6


def _number_between(lo, hi):
    return (lambda v: _is_number(v) and lo <= v <= hi), f"a number from {lo:g} to {hi:g}"


def _number_at_least(n, strict=False):
    if strict:
        return (lambda v: _is_number(v) and v > n), f"a number > {n}"
    return (lambda v: _is_number(v) and v >= n), f"a number >= {n}"


#: every `[[pool]]` key: (check, what it must be)
POOL_KEYS: dict[str, tuple] = {
    "name": (_name, "a non-empty string without spaces"),
    "model": (lambda v: isinstance(v, str) and v.strip() != "" and (":" not in v or all(v.split(":", 1))),
              "a shipped model name (echo, cartoon, convnet, chunks) or package.module:factory"),
    "count": _int_between(1, 1024),
    "device": (lambda v: isinstance(v, str) and _DEVICE.match(v.strip().lower()) is not None,
               "'auto', 'cpu', 'cuda' or 'cuda:N'"),
    "service": (lambda v: _name(v) and not v.startswith("mmi.") and len(v.encode()) <= 255,
                "a non-empty string without spaces, of at most 255 bytes, not starting with 'mmi.' (the broker's)"),
    "max_batch": _int_between(1, 1 << 16),
    "max_delay_ms": _number_between(0, _LONGEST_S * 1000),
    # inf: no bound (the worker's default, and what its --max-cost takes)
    "max_cost": (lambda v: (_is_number(v) or v == math.inf) and v > 0, "a number > 0 (inf: no bound)"),
    "credit": _int_between(1, 1 << 16),  # the broker refuses a READY with more
    "transports": (lambda v: isinstance(v, list) and v != [] and all(t in _TRANSPORTS for t in v),
                   f"a non-empty list of {', '.join(repr(t) for t in _TRANSPORTS)}"),
    # the worker's own bound (gpu_worker.worker.WorkerConfig.check): 0 (off), or 1 ms to a day
    "keep_warm_ms": (lambda v: _is_number(v) and (v == 0 or 1 <= v <= 86_400_000),
                     "0 (off), or a number of ms from 1 to 86400000 (a day)"),
    "drain_grace_s": _number_between(0, _LONGEST_S),
    # the worker's own bound (WorkerConfig.check): up to a day; negative: never newest first
    "lifo_after_ms": (lambda v: _is_number(v) and v <= 86_400_000,
                      "a number of ms up to 86400000 (a day), or negative (never newest first)"),
    "extra_args": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                   "a list of strings (python -m gpu_worker arguments)"),
}


@dataclass(frozen=True)
class LauncherConfig:
    """The pools and the `[launcher]` table: how long a shutdown waits for admitted requests
    (`drain_timeout_s`), how long a worker told to stop may take before SIGKILL
    (`stop_timeout_s`; default the largest drain grace + 10 s: `PoolConfig.grace`), and the restart backoff (the first
    restart after `restart_backoff_s`, doubling to `restart_backoff_max_s`, back to the first
    once a worker served `restart_reset_s` after its READY), and how long a worker may take to
    its READY before it is SIGKILLed as hung (`ready_timeout_s`: a model load that never
    ends would stall a rolling restart, or the start, for good), and how long a READY worker
    may be missing from the broker's registered workers before the same (`hang_timeout_s`;
    0: never: a SIGSTOPped or wedged worker would hold its slot for good)."""

    pools: tuple[PoolConfig, ...]
    drain_timeout_s: float = 30.0
    stop_timeout_s: float | None = None
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    restart_reset_s: float = 60.0
    ready_timeout_s: float = 600.0
    hang_timeout_s: float = 30.0
    source: str = field(default="", compare=False)

    @property
    def stop_timeout(self) -> float:
        if self.stop_timeout_s is not None:
            return self.stop_timeout_s
        return max(p.grace for p in self.pools) + 10.0

    @property
    def workers(self) -> int:
        return sum(p.count for p in self.pools)


#: every `[launcher]` key: (check, what it must be)
LAUNCHER_KEYS: dict[str, tuple] = {
    "drain_timeout_s": _number_between(0, _LONGEST_S),
    "stop_timeout_s": _number_between(0, _LONGEST_S),
    "restart_backoff_s": _number_between(0, _LONGEST_S),
    "restart_backoff_max_s": _number_between(0, _LONGEST_S),
    "restart_reset_s": _number_between(0, _LONGEST_S),
    "ready_timeout_s": _number_between(1, _LONGEST_S),
    "hang_timeout_s": _number_between(0, _LONGEST_S),
}


#: `python -m gpu_worker` flags the launcher sets from the broker itself: a pool's extra_args
#: may not set them (a worker pointed at another broker, or with other heartbeats, would
#: never be seen registered, and be killed as hung).  The worker takes no abbreviations
#: (tests/broker/test_launcher_logic.py checks these against its parser).
LAUNCHERS_FLAGS = {
    "--broker": "the launcher connects its workers to this broker's backend",
    "--model": "use the pool's model key",
    "--heartbeat-interval": "the launcher passes the broker's [scheduler] heartbeat_interval",
    "--heartbeat-liveness": "the launcher passes the broker's [scheduler] heartbeat_liveness",
    "--insecure": "the launcher passes it when the broker's backend is plain tcp",
    "--server-key": "the launcher passes the broker's own public key",
}


def _check_extra_args(table: dict, where: str) -> None:
    """Refuse extra_args that set what the launcher sets, or what a key of the same table
    sets (two values for one thing; argparse would take the last without a word), as
    `--flag value` or `--flag=value`."""
    keyed = {flag: key for key, flag in _FLAGS if key in table}
    for token in table.get("extra_args", ()):
        flag = token.split("=", 1)[0]
        why = LAUNCHERS_FLAGS.get(flag)
        if why is None and flag in keyed:
            why = f"the table's {keyed[flag]} key sets it already"
        if why is not None:
            raise ConfigError(f"{where}extra_args may not set {flag} ({token!r}): {why}")


def _pool(table: Any, where: str) -> PoolConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}must be a table, not {_show(table)}")
    if "name" in table and _name(table["name"]):
        where = f"{where[:-2]} (name {table['name']!r}): "
    for key, value in table.items():
        if key not in POOL_KEYS:
            raise _unknown(where, key, POOL_KEYS)
        ok, want = POOL_KEYS[key]
        if not ok(value):
            raise ConfigError(f"{where}{key} must be {want}, not {_show(value)}")
    if "model" not in table:
        raise ConfigError(f"{where}model is missing: a shipped model name (echo, cartoon, convnet, chunks) "
                          "or package.module:factory")
    _check_extra_args(table, where)
    if "cuda" in table.get("transports", ()) and str(table.get("device", "")).strip().lower() == "cpu":
        raise ConfigError(f"{where}transports has cuda, which a worker on device 'cpu' cannot take: leave it out")
    kw = dict(table)
    kw.setdefault("name", kw.get("service", kw["model"]))
    for key in ("transports", "extra_args"):
        if key in kw:
            kw[key] = tuple(kw[key])
    for key in ("max_delay_ms", "max_cost", "keep_warm_ms", "drain_grace_s", "lifo_after_ms"):
        if key in kw:
            kw[key] = float(kw[key])
    if "device" in kw:
        kw["device"] = kw["device"].strip().lower()
    return PoolConfig(**kw)


#: the shipped models (`python -m gpu_worker --model NAME`): each registers under its own name
_SHIPPED = ("echo", "cartoon", "convnet", "chunks")


def _known_service(p: PoolConfig) -> str | None:
    """The service a pool's workers register, where the file says it: its `service` key, a
    `--service` in its extra_args, or a shipped model's name (a factory's model names itself
    when it loads: None)."""
    if p.service is not None:
        return p.service
    given = _flag_values(p.extra_args, "--service")
    if given:
        return given[-1]
    return p.model if p.model in _SHIPPED else None


def launcher_from_data(data: Mapping[str, Any], path: str) -> LauncherConfig | None:
    """The launcher's part of a parsed deploy file, or None when it has no `[[pool]]`."""
    pools_data = data.get("pool")
    extra = data.get("launcher")
    if pools_data is None:
        if extra is not None:
            raise ConfigError(f"{path}: [launcher] without any [[pool]] table: add a [[pool]] or remove it")
        return None
    if not isinstance(pools_data, list) or not pools_data:
        raise ConfigError(f"{path}: pool must be an array of tables ([[pool]]), not {_show(pools_data)}")
    pools = []
    seen: dict[str, int] = {}
    served: dict[str, tuple[int, PoolConfig]] = {}  # service -> the first pool that serves it
    for i, table in enumerate(pools_data, 1):
        p = _pool(table, f"{path}: [[pool]] #{i}: ")
        if p.name in seen:
            raise ConfigError(f"{path}: [[pool]] #{i}: name {p.name!r} is taken by [[pool]] #{seen[p.name]}; "
                              "give each pool its own name")
        seen[p.name] = i
        service = _known_service(p)
        if service is not None:
            j, q = served.setdefault(service, (i, p))
            if q.model != p.model:
                # The broker sends each request of a service to any of its workers: the two
                # models' answers were mixed without a word (a warning only where both
                # declared signatures, and they differed).
                raise ConfigError(f"{path}: [[pool]] #{i} (name {p.name!r}): service {service!r} is served by "
                                  f"[[pool]] #{j} (name {q.name!r}) with another model ({q.model!r}, here "
                                  f"{p.model!r}), and each request would go to one model or the other; give each "
                                  f"pool its own service (pools of one service run one model)")
        pools.append(p)
    kw = {}
    if extra is not None:
        if not isinstance(extra, dict):
            raise ConfigError(f"{path}: launcher must be a table ([launcher]), not {_show(extra)}")
        for key, value in extra.items():
            if key not in LAUNCHER_KEYS:
                raise _unknown(f"{path}: [launcher] ", key, LAUNCHER_KEYS)
            ok, want = LAUNCHER_KEYS[key]
            if not ok(value):
                raise ConfigError(f"{path}: [launcher] {key} must be {want}, not {_show(value)}")
            kw[key] = float(value)
    first = kw.get("restart_backoff_s", LauncherConfig.restart_backoff_s)
    most = kw.get("restart_backoff_max_s", LauncherConfig.restart_backoff_max_s)
    if first > most:  # it was capped at the most without a word
        def shown(key: str, v: float) -> str:
            return f"{key} ({v:g}{'' if key in kw else ', the default'})"

        raise ConfigError(f"{path}: [launcher] {shown('restart_backoff_s', first)} is above "
                          f"{shown('restart_backoff_max_s', most)}: the first restart's wait cannot be longer than the "
                          "longest; set both")
    return LauncherConfig(pools=tuple(pools), source=path, **kw)


#: `python -m gpu_worker` flags that bind a port of their own: a fixed one (not 0) in a pool's
#: extra_args cannot be shared by the workers the launcher runs side by side
_PORT_FLAGS = ("--health-port", "--direct-tcp")


def _flag_values(args: Sequence[str], flag: str) -> list[str]:
    """The values `args` gives `flag`, as `--flag value` or `--flag=value`."""
    out = []
    for i, token in enumerate(args):
        if token == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif token.startswith(flag + "="):
            out.append(token[len(flag) + 1:])
    return out


def check_launch(deploy: LauncherConfig, backend: str = "") -> None:
    """What only the launcher cannot run (a worker started with `--pool NAME` on its own can):
    a pool whose extra_args set a fixed port.  The launcher runs the pool's workers side by
    side, and a worker beside its replacement in every rolling restart (SIGHUP): only the
    first bound the port, and the others exited and were restarted with backoff for good
    (the roll never ended; with count > 1 the start failed).  And a worker flag (a service
    name, a model path, ``backend``) that this locale cannot pass to a process: under an
    ASCII one (PYTHONUTF8=0 LC_ALL=C) a ``service = "café"`` was a traceback at every
    start and "exited with code 127 before it was ready: (it wrote nothing on stderr)"
    (the streams hunt).  ConfigError, one line."""
    for p in deploy.pools:
        for arg in p.worker_args(backend):
            try:
                os.fsencode(arg)
            except UnicodeEncodeError:
                raise ConfigError(
                    f"{deploy.source}: [[pool]] {p.name!r}: the worker flag {arg!r} cannot be passed to a process "
                    f"under this locale (its encoding is {sys.getfilesystemencoding()}): run the launcher under a "
                    f"UTF-8 locale (LANG=C.UTF-8, without PYTHONUTF8=0), or keep the pool's names and paths ASCII"
                ) from None
        for flag in _PORT_FLAGS:
            for value in _flag_values(p.extra_args, flag):
                port = value.rpartition(":")[2].strip("[]/")
                if port.isdigit() and int(port) != 0:
                    side = f"its {p.count} workers, and a worker and " if p.count > 1 else "a worker and "
                    raise ConfigError(
                        f"{deploy.source}: [[pool]] {p.name!r}: extra_args gives {flag} the fixed port {port} "
                        f"({value!r}), but the launcher runs {side}its replacement in a rolling restart (SIGHUP) "
                        f"side by side, and only one can bind it: use port 0 (each worker's READY line names its "
                        f"own), or give a fixed port to a worker run on its own "
                        f"(--pool {p.name} -- {flag} {value})")


def load_launcher(path: str) -> LauncherConfig | None:
    """`launcher_from_data` of the file at `path`."""
    return launcher_from_data(read_toml(path), path)
