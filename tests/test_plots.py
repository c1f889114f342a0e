"""bench/plots.py: each plot function writes a valid, non-blank PNG and returns its link
path. Fast, needs no platform."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import plots  # noqa: E402

mpimg = pytest.importorskip("matplotlib.image")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png(out_dir: str, rel: str, name: str) -> None:
    assert rel == f"img/{name}.png"
    path = os.path.join(out_dir, f"{name}.png")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 600
    assert float(img[..., :3].var()) > 1e-3  # not a blank canvas


def samples(mu: float, n: int = 200, seed: int = 1) -> list[float]:
    rnd = random.Random(seed)
    return [rnd.lognormvariate(mu, 0.3) for _ in range(n)]


@pytest.mark.parametrize("logx", [False, True])
def test_latency_cdf(tmp_path: Path, logx: bool) -> None:
    d = str(tmp_path)
    rel = plots.latency_cdf({"raw crun": samples(3.2), "dsec": samples(3.0, seed=2)}, bench="t", name="cdf",
                            title="create to first exec", logx=logx, out_dir=d)
    check_png(d, rel, "t-cdf")


@pytest.mark.parametrize("logx", [False, True])
def test_latency_histogram(tmp_path: Path, logx: bool) -> None:
    d = str(tmp_path)
    rel = plots.latency_histogram({"baseline": samples(2.0), "dsec": samples(0.5, seed=3)}, bench="t",
                                  name="hist", title="exec round trip", logx=logx, out_dir=d)
    check_png(d, rel, "t-hist")


def test_throughput_vs_concurrency(tmp_path: Path) -> None:
    d = str(tmp_path)
    rel = plots.throughput_vs_concurrency({"baseline": {1: 21.0, 8: 48.7, 32: 45.5},
                                           "dsec": {1: 114.9, 8: 237.8, 32: 232.3}},
                                          bench="t", name="tput", title="python hello", out_dir=d)
    check_png(d, rel, "t-tput")


def test_density_curve(tmp_path: Path) -> None:
    d = str(tmp_path)
    xs = list(range(0, 1000, 8))
    rel = plots.density_curve({"MemAvailable": (xs, [20000 - 6 * x for x in xs])}, bench="t", name="density",
                              title="fill", ylabel="MemAvailable (MiB)", hlines={"target": 1000.0}, out_dir=d)
    check_png(d, rel, "t-density")


def test_bar_compare(tmp_path: Path) -> None:
    d = str(tmp_path)
    rel = plots.bar_compare(["bare", "cold", "template"], {"p50": [2443.0, 2911.0, 411.0],
                                                           "other": [float("nan"), 100.0, 50.0]},
                            bench="t", name="bars", title="boot", ylabel="ms",
                            errors={"p50": [100.0, 200.0, 30.0]}, out_dir=d)
    check_png(d, rel, "t-bars")
    rel = plots.bar_compare(["baseline", "dsec"], {"median": [2443.0, 411.0]}, bench="t", name="bars1",
                            title="boot", ylabel="ms", baseline_group=0, logy=True, out_dir=d)
    check_png(d, rel, "t-bars1")


def test_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        plots.latency_cdf({"a": []}, bench="t", name="x", title="t", out_dir=str(tmp_path))
    with pytest.raises(ValueError):
        plots.latency_cdf({"a": [1.0]}, bench="t", name="../x", title="t", out_dir=str(tmp_path))
    assert plots.image_link("cap", "img/a.png") == "![cap](img/a.png)"
