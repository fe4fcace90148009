"""bench.inputs: the request sources of `python -m bench run` (random, npz, images, video)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from bench import inputs
from bench.inputs import InputError


# ------------------------------------------------------------------------------ specs


@pytest.mark.parametrize("text, name, shape, dtype", [
    ("x=16:uint8", "x", (16,), "uint8"),
    ("image=720x1280x3:uint8", "image", (720, 1280, 3), "uint8"),
    ("ids=1x128:int64", "ids", (1, 128), "int64"),
    ("ids=1,128:int64", "ids", (1, 128), "int64"),
    ("s=1:float32", "s", (1,), "float32"),
    ("m=2x2:bool", "m", (2, 2), "bool"),
    ("h=3:float16", "h", (3,), "float16"),
])
def test_parse_input_spec(text, name, shape, dtype):
    assert inputs.parse_input_spec(text) == (name, shape, np.dtype(dtype))


@pytest.mark.parametrize("text, says", [
    ("x16:uint8", "NAME=SHAPE:DTYPE"),     # no '='
    ("x=16", "NAME=SHAPE:DTYPE"),          # no ':'
    ("=16:uint8", "NAME=SHAPE:DTYPE"),     # no name
    ("s=:float32", "empty shape"),
    ("x=16xa:uint8", "'a'"),
    ("x=16x:uint8", "bad dimension"),
    ("x=0:uint8", "'0'"),
    ("x=-3:uint8", "'-3'"),
    ("x=4:nosuch", "'nosuch'"),
    ("x=4:object", "'object'"),
    ("x=4:U3", "unknown dtype"),
    ("x=4:>i4", "unknown dtype"),
])
def test_parse_input_spec_errors(text, says):
    with pytest.raises(InputError, match="--input") as e:
        inputs.parse_input_spec(text)
    assert says in str(e.value) and repr(text) in str(e.value)


# ----------------------------------------------------------------------------- random


SPECS = ["x=16:uint8", "ids=1x128:int64", "u=64:uint64", "f=2x3:float16", "g=5:float32", "m=7:bool"]


def test_random_samples_shapes_dtypes_and_count():
    got = inputs.random_samples(SPECS, seed=3, samples=4)
    assert len(got) == 4
    for s in got:
        assert list(s) == ["x", "ids", "u", "f", "g", "m"]
        for (name, shape, dtype), arr in zip(map(inputs.parse_input_spec, SPECS), s.values()):
            assert arr.shape == shape and arr.dtype == dtype and arr.flags.c_contiguous
    assert not np.array_equal(got[0]["ids"], got[1]["ids"])  # distinct requests
    assert set(np.unique(np.concatenate([s["m"] for s in got]))) <= {False, True}


def test_random_samples_cover_the_integer_range():
    big = inputs.random_samples(["b=4096:uint8", "i=4096:int8", "w=4096:int64"], seed=1)[0]
    assert big["b"].min() < 8 and big["b"].max() > 247
    assert big["i"].min() < -120 and big["i"].max() > 119
    assert big["w"].min() < -2**62 and big["w"].max() > 2**62
    f = inputs.random_samples(["f=10000:float64"], seed=1)[0]["f"]
    assert abs(f.mean()) < 0.05 and abs(f.std() - 1) < 0.05


def test_random_samples_deterministic_across_processes():
    a = inputs.random_samples(SPECS, seed=7, samples=2)
    b = inputs.random_samples(SPECS, seed=7, samples=2)
    c = inputs.random_samples(SPECS, seed=8, samples=2)
    dig = lambda ss: [{k: inputs.digest(v) for k, v in s.items()} for s in ss]  # noqa: E731
    assert dig(a) == dig(b)
    assert dig(a)[0]["ids"] != dig(c)[0]["ids"]
    code = ("from bench import inputs; import json; "
            f"print(json.dumps([{{k: inputs.digest(v) for k, v in s.items()}} "
            f"for s in inputs.random_samples({SPECS!r}, seed=7, samples=2)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == json.dumps(dig(a))


def test_random_samples_errors():
    with pytest.raises(InputError, match="more than once: x"):
        inputs.random_samples(["x=1:uint8", "x=2:uint8"], seed=1)
    with pytest.raises(InputError, match="--samples 0"):
        inputs.random_samples(["x=1:uint8"], seed=1, samples=0)
    with pytest.raises(InputError, match="at least one"):
        inputs.random_samples([], seed=1)


# -------------------------------------------------------------------------------- npz


def test_npz_file_and_dir_round_trip(tmp_path):
    a = {"x": np.arange(12, dtype=np.float16).reshape(3, 4), "ids": np.array([[1, -2, 3]], np.int64),
         "m": np.array([True, False])}
    b = {"x": np.full((3, 4), 2.5, np.float16), "ids": np.array([[9, 9, 9]], np.int64),
         "m": np.array([False, False])}
    d = tmp_path / "reqs"
    d.mkdir()
    np.savez(d / "b.npz", **b)
    np.savez_compressed(d / "a.npz", **a)
    (d / "notes.txt").write_text("ignored")

    def same(got, want):
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            assert got[k].tobytes() == want[k].tobytes()

    [one] = inputs.npz_samples(str(d / "b.npz"))
    same(one, b)
    two = inputs.npz_samples(str(d))
    assert len(two) == 2
    same(two[0], a)  # file-name order
    same(two[1], b)


def test_npz_errors(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        inputs.npz_samples(str(tmp_path / "missing.npz"))
    with pytest.raises(InputError, match="no .npz files"):
        inputs.npz_samples(str(tmp_path))
    np.savez(tmp_path / "empty.npz")
    with pytest.raises(InputError, match="holds no arrays"):
        inputs.npz_samples(str(tmp_path / "empty.npz"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(InputError, match="junk.npz"):
        inputs.npz_samples(str(tmp_path / "junk.npz"))
    np.savez(tmp_path / "obj.npz", o=np.array([{"a": 1}], dtype=object))
    with pytest.raises(InputError, match="obj.npz"):
        inputs.npz_samples(str(tmp_path / "obj.npz"))
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(InputError, match="not a .npz"):
        inputs.npz_samples(str(tmp_path / "single.npy"))


# ----------------------------------------------------------------------------- images


def test_image_folder(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    rgba = rng.integers(0, 256, (4, 7, 4), dtype=np.uint8)
    gray = rng.integers(0, 256, (3, 2), dtype=np.uint8)
    Image.fromarray(rgb, "RGB").save(tmp_path / "b_rgb.png")
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a_rgba.PNG")
    Image.fromarray(gray, "L").save(tmp_path / "c_gray.bmp")
    (tmp_path / "readme.txt").write_text("not an image")
    (tmp_path / "sub.png").mkdir()  # a folder named like an image is skipped

    got = inputs.image_samples(str(tmp_path), name="img")
    assert [list(s) for s in got] == [["img"]] * 3
    arrs = [s["img"] for s in got]
    for a in arrs:
        assert a.dtype == np.uint8 and a.ndim == 3 and a.shape[2] == 3 and a.flags.c_contiguous
    np.testing.assert_array_equal(arrs[0], rgba[:, :, :3])  # a_rgba: alpha dropped
    np.testing.assert_array_equal(arrs[1], rgb)
    np.testing.assert_array_equal(arrs[2], np.repeat(gray[:, :, None], 3, axis=2))

    resized = inputs.image_samples(str(tmp_path), resize=(10, 8))
    assert [s["image"].shape for s in resized] == [(8, 10, 3)] * 3


def test_image_errors(tmp_path):
    with pytest.raises(InputError, match="not a folder"):
        inputs.image_samples(str(tmp_path / "nope"))
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(InputError, match="no images"):
        inputs.image_samples(str(tmp_path))
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 truncated garbage")
    with pytest.raises(InputError, match="broken.jpg"):
        inputs.image_samples(str(tmp_path))


# ------------------------------------------------------------------------------ video


def _write_video(path, frames: int = 5, w: int = 64, h: int = 48):
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            img = np.full((h, w, 3), 40 * i, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def test_video_frames(tmp_path):
    path = tmp_path / "clip.mp4"
    _write_video(path)
    got = inputs.video_samples(str(path))
    assert len(got) == 5
    for i, s in enumerate(got):
        a = s["image"]
        assert a.shape == (48, 64, 3) and a.dtype == np.uint8 and a.flags.c_contiguous
        assert abs(float(a.mean()) - 40 * i) < 8  # the frames, in order (lossy codec)
    assert len(inputs.video_samples(str(path), max_frames=3)) == 3
    small = inputs.video_samples(str(path), name="frame", resize=(32, 16), max_frames=2)
    assert [s["frame"].shape for s in small] == [(16, 32, 3)] * 2


def test_video_errors(tmp_path):
    bad = tmp_path / "notes.mp4"
    bad.write_bytes(b"this is not a video file\n" * 20)
    with pytest.raises(InputError, match="notes.mp4"):
        inputs.video_samples(str(bad))
    with pytest.raises(InputError, match="no such file"):
        inputs.video_samples(str(tmp_path / "missing.mp4"))
    with pytest.raises(InputError, match="--max-frames 0"):
        inputs.video_samples(str(bad), max_frames=0)


def test_video_without_pyav(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "av", None)  # makes `import av` raise ImportError
    with pytest.raises(InputError, match="pip install av"):
        inputs.video_samples(str(tmp_path / "x.mp4"))


# ------------------------------------------------------------------- resize, describe


def test_parse_resize():
    assert inputs.parse_resize("1280x720") == (1280, 720)
    assert inputs.parse_resize("64X48") == (64, 48)
    for bad in ("1280", "0x720", "axb", "12x-3", "1x2x3", ""):
        with pytest.raises(InputError, match="--resize"):
            inputs.parse_resize(bad)


def test_digest_is_stable_and_c_ordered():
    a = np.arange(24, dtype=np.uint8).reshape(4, 6)
    assert inputs.digest(a) == inputs.digest(a.copy()) == inputs.digest(np.asfortranarray(a))
    assert len(inputs.digest(a)) == 16 and int(inputs.digest(a), 16) >= 0
    assert inputs.digest(np.arange(3, dtype=np.uint8)) == "ae4b3280e56e2faf"  # sha256(b"\0\1\2")
    assert inputs.digest(a) != inputs.digest(a.T)


def test_describe():
    samples = [{"x": np.zeros(16, np.uint8), "y": np.zeros((2, 3), np.float32)},
               {"x": np.ones(16, np.uint8), "y": np.ones((2, 3), np.float32)}] + \
              [{"x": np.zeros(16, np.uint8), "y": np.zeros((2, 3), np.float32)}] * 70
    d = inputs.describe(samples, "random", None)
    assert d["source"] == "random" and d["path"] is None and d["samples"] == 72
    assert d["tensors"] == {"x": {"shape": [16], "dtype": "uint8"}, "y": {"shape": [2, 3], "dtype": "float32"}}
    assert d["bytes_per_request"] == 16 + 24
    assert len(d["digests"]) == 64 and d["digests"][0] == d["digests"][2] != d["digests"][1]
    assert d["digests"][0] == {"x": inputs.digest(samples[0]["x"]), "y": inputs.digest(samples[0]["y"])}


# ----------------------------------------------------------------------- load_samples


def test_load_samples_sources(tmp_path):
    got, d = inputs.load_samples(inputs=["x=16:uint8"], samples=3, seed=5)
    assert len(got) == 3 and d["source"] == "random" and d["path"] is None and d["samples"] == 3
    assert d["bytes_per_request"] == 16
    assert [g["x"].tobytes() for g in got] == [g["x"].tobytes() for g in inputs.random_samples(["x=16:uint8"], 5, 3)]

    np.savez(tmp_path / "r.npz", a=np.arange(4))
    got, d = inputs.load_samples(npz=str(tmp_path / "r.npz"))
    assert d["source"] == "npz" and d["path"] == str(tmp_path / "r.npz") and list(got[0]) == ["a"]

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    Image.fromarray(np.zeros((4, 6, 3), np.uint8)).save(imgs / "a.png")
    got, d = inputs.load_samples(images=str(imgs), image_input="pic", resize="3x2")
    assert d["source"] == "images" and d["tensors"] == {"pic": {"shape": [2, 3, 3], "dtype": "uint8"}}

    _write_video(tmp_path / "v.mp4", frames=4)
    got, d = inputs.load_samples(video=str(tmp_path / "v.mp4"), max_frames=2, resize="32x24")
    assert d["source"] == "video" and d["samples"] == 2 and got[0]["image"].shape == (24, 32, 3)


def test_load_samples_option_errors(tmp_path):
    one_of = "give exactly one of --input, --npz, --images, --video"
    with pytest.raises(InputError, match=one_of):
        inputs.load_samples()
    with pytest.raises(InputError, match=one_of):
        inputs.load_samples(inputs=[])
    with pytest.raises(InputError, match=one_of):
        inputs.load_samples(inputs=["x=1:uint8"], npz=str(tmp_path))
    with pytest.raises(InputError, match=one_of):
        inputs.load_samples(images=str(tmp_path), video=str(tmp_path / "v.mp4"))
    with pytest.raises(InputError, match="--resize"):
        inputs.load_samples(inputs=["x=1:uint8"], resize="2x2")
    with pytest.raises(InputError, match="--resize"):
        inputs.load_samples(npz=str(tmp_path), resize="2x2")
    with pytest.raises(InputError, match="--samples 4"):
        inputs.load_samples(npz=str(tmp_path), samples=4)
    with pytest.raises(InputError, match="--resize 'big'"):
        inputs.load_samples(images=str(tmp_path), resize="big")
