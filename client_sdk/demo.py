"""`make demo`: an AR filter gateway in miniature.

Starts a broker and two `cartoon` workers as separate processes, then streams frames of a
moving 720p scene at 30 fps through shared memory with `latest_wins` (a frame that would queue
behind a newer one is dropped, as a live camera view wants), prints latency percentiles,
achieved fps and dropped frames, writes a before/after PNG, and stops everything it started,
leaving no process and no /dev/shm file behind.

The scene is a real photograph that matplotlib ships (Grace Hopper, mpl-data/sample_data),
panned and zoomed over a 1280x720 canvas so that every frame differs like a camera's.

    python -m client_sdk.demo [--frames 240] [--fps 30] [--workers 2] [--size 1280x720] [--out out]
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np


def _photo(width: int, height: int) -> np.ndarray:
    """The sample photograph on a canvas 10% wider than the frame (room to pan)."""
    try:
        import matplotlib.cbook as cbook
        from PIL import Image

        path = cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
        img = Image.open(path).convert("RGB")
        canvas_w = int(width * 1.1)
        scale = max(canvas_w / img.width, height / img.height)
        img = img.resize((int(img.width * scale + 0.5), int(img.height * scale + 0.5)), Image.BILINEAR)
        arr = np.asarray(img)
        top = (arr.shape[0] - height) // 2
        return np.ascontiguousarray(arr[top : top + height, :canvas_w])
    except Exception as e:  # no matplotlib/PIL: a generated scene, still with edges and colours
        print(f"(sample photo unavailable: {e}; using a generated scene)", file=sys.stderr)
        yy, xx = np.mgrid[0:height, 0 : int(width * 1.1)]
        r = (128 + 127 * np.sin(xx / 37.0)).astype(np.uint8)
        g = (128 + 127 * np.cos(yy / 23.0)).astype(np.uint8)
        b = ((xx // 80 + yy // 80) % 2 * 200).astype(np.uint8)
        return np.stack([r, g, b], axis=-1)


def _start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, env=env)


def _wait_ready(p: subprocess.Popen, what: str, timeout: float = 120.0) -> str:
    """Wait for the process's READY line (no sleeps: select on its stdout)."""
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what} did not start within {timeout:.0f} s")
        r, _, _ = select.select([p.stdout], [], [], left)
        if r:
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"{what} exited with code {p.wait()}")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        if p.stdout:
            p.stdout.close()


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client_sdk.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=240)
    ap.add_argument("--fps", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size", default="1280x720", help="WIDTHxHEIGHT")
    ap.add_argument("--out", default="out", help="folder for the before/after PNG")
    ap.add_argument("--timeout", type=float, default=1.0, help="per-frame deadline in seconds")
    args = ap.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))

    from client_sdk import Client, EndOfStream, InferenceError
    from shm import gc as shm_gc

    tmp = tempfile.mkdtemp(prefix="zmq-infer-demo-")
    fe, be = f"ipc://{tmp}/frontend.ipc", f"ipc://{tmp}/backend.ipc"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Two workers on two cores: one torch thread each, or they fight over the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    procs: list[subprocess.Popen] = []
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    try:
        procs.append(_start(["-m", "broker", "--frontend", fe, "--backend", be], env))
        _wait_ready(procs[-1], "broker")
        for _ in range(args.workers):
            procs.append(_start(["-m", "gpu_worker", "--broker", be, "--model", "cartoon", "--max-batch", "2"], env))
        for i, p in enumerate(procs[1:]):
            print(_wait_ready(p, f"worker {i}"))
        scene = _photo(width, height)
        pan = scene.shape[1] - width

        with Client(fe, timeout=10) as client:
            deadline = time.monotonic() + 30
            while not client.mmi_service("cartoon"):
                if time.monotonic() > deadline:
                    raise TimeoutError("cartoon workers did not register")
                time.sleep(0.01)
            # The "camera" writes each frame into shared memory once; the request carries a
            # reference to it.  A capture ring of max_in_flight + 2 buffers (at most
            # max_in_flight + 1 frames are unfinished with latest_wins).
            ring = [client.alloc((height, width, 3), np.uint8) for _ in range(args.workers + 2)]
            last = [None] * len(ring)  # the frame each buffer last carried
            before = after = None
            stream = client.stream("cartoon", latest_wins=True, max_in_flight=args.workers, timeout=args.timeout)
            t0 = time.monotonic()
            with stream:
                for i in range(args.frames):
                    due = t0 + i / args.fps
                    # Collect results until this frame is due.
                    while (left := due - time.monotonic()) > 0:
                        try:
                            res = stream.recv(timeout=left)
                        except EndOfStream:  # (an InferenceError: before it)
                            time.sleep(left)  # nothing in flight: the camera waits for its next frame
                            break
                        except InferenceError as e:  # the frame's own error (before TimeoutError:
                            print(f"frame failed: {e}", file=sys.stderr)  # DeadlineExceeded is one)
                            continue
                        except TimeoutError:
                            break
                        if after is None:
                            after = np.array(res["image"])  # keep one result past its release
                        res.release()
                    x = int(pan * (0.5 + 0.5 * np.sin(i / 25.0)))
                    # A buffer whose last frame is no longer unfinished (docs/client.md,
                    # "Streams": round robin is not safe once frames are dropped).
                    busy = stream.unfinished()
                    k = next(k for k, f in enumerate(last) if f not in busy)
                    frame = ring[k]
                    np.copyto(frame, scene[:, x : x + width])
                    if i == 0:
                        before = frame.copy()
                    last[k] = stream.send({"image": frame})
                while True:
                    try:
                        res = stream.recv(timeout=10)
                    except EndOfStream:
                        break
                    except InferenceError as e:
                        print(f"frame failed: {e}", file=sys.stderr)
                        continue
                    if after is None:
                        after = np.array(res["image"])
                    res.release()
                wall = time.monotonic() - t0
                st = stream.stats()
            for buf in ring:
                client.free(buf)

        lat = list(st.latencies_ms)
        print()
        print(f"cartoon filter, {width}x{height} RGB frames offered at {args.fps:g} fps, "
              f"{args.workers} workers, shared memory, latest frame wins")
        print(f"{'frames':>8} {'done':>6} {'dropped':>8} {'failed':>7} {'fps':>7} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
        print(f"{args.frames:8d} {st.completed:6d} {st.dropped:8d} {st.failed + st.expired:7d} "
              f"{st.completed / wall:7.1f} {_pct(lat, 50):8.1f} {_pct(lat, 90):8.1f} {_pct(lat, 99):8.1f}")
        if before is not None and after is not None:
            from PIL import Image

            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, "cartoon_before_after.png")
            Image.fromarray(np.hstack([before, after])).save(path)
            print(f"\nbefore | after: {path}")
        return 0
    finally:
        _stop(procs)
        for name in ("frontend.ipc", "backend.ipc"):
            try:
                os.unlink(os.path.join(tmp, name))
            except OSError:
                pass
        try:
            os.rmdir(tmp)
        except OSError:
            pass
        shm_gc.collect()  # /dev/shm files of earlier versions (segments are memfds now)
        left = set(os.listdir("/dev/shm")) - shm_before if os.path.isdir("/dev/shm") else set()
        # Ours: segments whose owner (the pid in the name) is this process or one it started.
        # Other programs on the host may create segments meanwhile; they are not our leftovers.
        mine = {str(os.getpid())} | {str(p.pid) for p in procs}
        left = {n for n in left if n.startswith("zinf-") and n.split("-")[1] in mine}
        if left:
            print(f"warning: left in /dev/shm: {sorted(left)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
