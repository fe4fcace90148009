"""Where `python -m bench run` gets its requests' inputs from.

One of four sources, each turned into a list of samples (one dict of arrays per request)
before the first timed request, so that no decoding or generating happens inside the timing:

    --input NAME=SHAPE:DTYPE   seeded random tensors (`random_samples`)
    --npz PATH                 a .npz file, or a folder of them (`npz_samples`)
    --images DIR               a folder of images decoded with Pillow (`image_samples`)
    --video PATH               a video's frames decoded with PyAV (`video_samples`)

`load_samples` picks the source from the options and also returns the report's `inputs`
object (`describe`), which carries a digest of every sample so that two runs can be shown
to have sent the same bytes.  Every bad option or file raises `InputError` naming it.
"""
from __future__ import annotations

import hashlib
import os
import re
import zipfile

import numpy as np

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
DIGESTS_KEPT = 64  # describe() lists the digests of this many samples at most
_DIMS = re.compile(r"[x,]")


class InputError(ValueError):
    """A bad input option or input file; the message names the option and the path/value."""


# ---------------------------------------------------------------------------------- random


def parse_input_spec(text: str) -> tuple[str, tuple[int, ...], np.dtype]:
    """`"image=720x1280x3:uint8"` -> `("image", (720, 1280, 3), dtype('uint8'))`."""
    name, eq, rest = text.partition("=")
    shape_text, colon, dtype_text = rest.rpartition(":")
    name, shape_text, dtype_text = name.strip(), shape_text.strip(), dtype_text.strip()
    if not eq or not colon or not name:
        raise InputError(f"--input {text!r}: expected NAME=SHAPE:DTYPE, e.g. x=1x128:int64")
    if not shape_text:
        raise InputError(f"--input {text!r}: empty shape (dims separated by 'x', e.g. 16 or 720x1280x3)")
    dims = []
    for d in _DIMS.split(shape_text):
        if not d.strip().isdecimal() or int(d) <= 0:
            raise InputError(f"--input {text!r}: bad dimension {d.strip()!r} (each must be a positive integer)")
        dims.append(int(d))
    try:
        dtype = np.dtype(dtype_text)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biuf" or not dtype.isnative:
        raise InputError(f"--input {text!r}: unknown dtype {dtype_text!r} "
                         "(use bool, int8..int64, uint8..uint64, float16/32/64)")
    return name, tuple(dims), dtype


def _random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "b":
        return rng.integers(0, 1, shape, dtype=np.uint8, endpoint=True).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def random_samples(specs: list[str], seed: int, samples: int = 1) -> list[dict[str, np.ndarray]]:
    """`samples` requests of seeded random tensors, one per spec; the same arguments give the
    same bytes in any process.  Integers are uniform over the dtype's range, bool 0/1, floats
    standard normal."""
    if not specs:
        raise InputError("--input: give at least one NAME=SHAPE:DTYPE")
    if samples < 1:
        raise InputError(f"--samples {samples}: must be at least 1")
    parsed = [parse_input_spec(s) for s in specs]
    names = [name for name, _, _ in parsed]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InputError(f"--input: input name(s) given more than once: {', '.join(dupes)}")
    rng = np.random.default_rng(seed)
    return [{name: np.ascontiguousarray(_random_array(rng, shape, dtype)) for name, shape, dtype in parsed}
            for _ in range(samples)]


# ------------------------------------------------------------------------------------- npz


def _load_npz(path: str) -> dict[str, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise InputError(f"--npz {path}: cannot read it as .npz ({e})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InputError(f"--npz {path}: a single .npy array, not a .npz archive (use np.savez)")
    with loaded:
        try:
            arrays = {k: np.ascontiguousarray(loaded[k]) for k in loaded.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise InputError(f"--npz {path}: cannot read its arrays ({e})") from None
    if not arrays:
        raise InputError(f"--npz {path}: holds no arrays")
    return arrays


def npz_samples(path: str) -> list[dict[str, np.ndarray]]:
    """A .npz file is one request (its arrays by name); a folder is one request per *.npz
    file in it, in file-name order."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path)
                       if f.lower().endswith(".npz") and os.path.isfile(os.path.join(path, f)))
        if not files:
            raise InputError(f"--npz {path}: the folder has no .npz files")
        return [_load_npz(os.path.join(path, f)) for f in files]
    if not os.path.exists(path):
        raise InputError(f"--npz {path}: no such file or folder")
    return [_load_npz(path)]


# ------------------------------------------------------------------------- images, video


def parse_resize(text: str) -> tuple[int, int]:
    """`"1280x720"` -> `(1280, 720)`: (width, height)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text or "")
    if not m or int(m[1]) <= 0 or int(m[2]) <= 0:
        raise InputError(f"--resize {text!r}: expected WIDTHxHEIGHT, e.g. 1280x720")
    return int(m[1]), int(m[2])


def _check_name(name: str) -> None:
    if not name:
        raise InputError("--image-input: the input name must not be empty")


def image_samples(folder: str, name: str = "image",
                  resize: tuple[int, int] | None = None) -> list[dict[str, np.ndarray]]:
    """Every image in `folder` (file-name order) as an HxWx3 uint8 RGB array, one request each;
    `resize=(W, H)` scales them (bilinear)."""
    from PIL import Image

    _check_name(name)
    if not os.path.isdir(folder):
        raise InputError(f"--images {folder}: not a folder")
    files = sorted(f for f in os.listdir(folder)
                   if f.lower().endswith(IMAGE_EXTENSIONS) and os.path.isfile(os.path.join(folder, f)))
    if not files:
        raise InputError(f"--images {folder}: no images ({', '.join(e[1:] for e in IMAGE_EXTENSIONS)}) in it")
    out = []
    for f in files:
        path = os.path.join(folder, f)
        try:
            with Image.open(path) as im:
                rgb = im.convert("RGB")
            if resize is not None:
                rgb = rgb.resize(resize, Image.Resampling.BILINEAR)
            arr = np.array(rgb, dtype=np.uint8)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise InputError(f"--images {folder}: cannot decode {path} ({e})") from None
        out.append({name: np.ascontiguousarray(arr)})
    return out


def video_samples(path: str, name: str = "image", resize: tuple[int, int] | None = None,
                  max_frames: int = 300) -> list[dict[str, np.ndarray]]:
    """The first `max_frames` frames of a video as HxWx3 uint8 RGB arrays, one request each;
    `resize=(W, H)` scales them (bilinear)."""
    try:
        import av
    except ImportError:
        raise InputError("--video needs PyAV: pip install av") from None
    _check_name(name)
    if max_frames < 1:
        raise InputError(f"--max-frames {max_frames}: must be at least 1")
    if not os.path.isfile(path):
        raise InputError(f"--video {path}: no such file")
    width, height = resize if resize is not None else (None, None)
    out = []
    try:
        container = av.open(path)
    except (av.FFmpegError, OSError) as e:
        raise InputError(f"--video {path}: not a video PyAV can open ({e})") from None
    try:
        if not container.streams.video:
            raise InputError(f"--video {path}: has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            arr = frame.to_ndarray(format="rgb24", width=width, height=height, interpolation="BILINEAR")
            out.append({name: np.ascontiguousarray(arr, dtype=np.uint8)})
            if len(out) >= max_frames:
                break
    except av.FFmpegError as e:
        raise InputError(f"--video {path}: decoding failed after {len(out)} frames ({e})") from None
    finally:
        container.close()
    if not out:
        raise InputError(f"--video {path}: no frames decoded")
    return out


# ----------------------------------------------------------------------- report, choice


def digest(arr: np.ndarray) -> str:
    """sha256 of the array's C-ordered bytes, first 16 hex digits."""
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]


def describe(samples: list[dict], source: str, path: str | None) -> dict:
    """The report's `inputs` object."""
    first = samples[0] if samples else {}
    total = sum(sum(a.nbytes for a in s.values()) for s in samples)
    return {
        "source": source,
        "path": path,
        "samples": len(samples),
        "tensors": {k: {"shape": list(a.shape), "dtype": a.dtype.name} for k, a in first.items()},
        "bytes_per_request": int(round(total / len(samples))) if samples else 0,
        "digests": [{k: digest(a) for k, a in s.items()} for s in samples[:DIGESTS_KEPT]],
    }


def load_samples(*, inputs: list[str] | None = None, npz: str | None = None, images: str | None = None,
                 video: str | None = None, image_input: str = "image", resize: str | None = None,
                 max_frames: int = 300, samples: int = 1,
                 seed: int = 1) -> tuple[list[dict[str, np.ndarray]], dict]:
    """Load the one source the options name; returns (samples, the report's `inputs`)."""
    given = [opt for opt, v in (("--input", inputs or None), ("--npz", npz), ("--images", images),
                                ("--video", video)) if v is not None]
    if len(given) != 1:
        extra = f" (got {', '.join(given)})" if given else ""
        raise InputError(f"give exactly one of --input, --npz, --images, --video{extra}")
    if resize is not None and images is None and video is None:
        raise InputError(f"--resize {resize}: only applies to --images or --video")
    if samples != 1 and not inputs:
        raise InputError(f"--samples {samples}: only applies to --input (random tensors)")
    size = parse_resize(resize) if resize is not None else None
    if inputs:
        out, source, path = random_samples(inputs, seed, samples), "random", None
    elif npz is not None:
        out, source, path = npz_samples(npz), "npz", npz
    elif images is not None:
        out, source, path = image_samples(images, image_input, size), "images", images
    else:
        out, source, path = video_samples(video, image_input, size, max_frames), "video", video
    return out, describe(out, source, path)
