"""What a benchmark's plot drew, not only that a file was written: the figures saved during a
test (matplotlib keeps their artists after plt.close), a PNG's pixel size and how much of it
is not white."""

from __future__ import annotations

import os
import struct


def capture_figures(monkeypatch) -> dict:
    """Record every matplotlib figure saved from now on, by file name."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved: dict = {}
    real = Figure.savefig

    def savefig(self, fname, *args, **kw):
        saved[os.path.basename(str(fname))] = self
        return real(self, fname, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def png_size(path) -> tuple:
    """(width, height) from a PNG's IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def drawn_share(path) -> float:
    """The fraction of the image's pixels that are not white (a blank figure has none)."""
    import matplotlib.image

    rgb = matplotlib.image.imread(str(path))[..., :3]
    return float((rgb < 0.98).any(-1).mean())


def series(ax) -> dict:
    """label -> (xdata, ydata) of the axes' labelled lines."""
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()
            if not ln.get_label().startswith("_")}
