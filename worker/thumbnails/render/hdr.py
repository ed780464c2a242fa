"""HDR pictures (HEIC/AVIF coded with the PQ or HLG transfer, BT.2020 primaries) shown on an
ordinary (SDR, sRGB) screen.

libavif and libheif hand over 10- and 12-bit pictures as 8-bit RGB, but in the file's own
transfer: PQ code values shown as sRGB look grey and dim, BT.2020 colours pale. The thumbnail is
small, so the fix is applied to it after the resize: each channel's code value goes through the
transfer's inverse (PQ: absolute nits; HLG: scene light with the 1000-nit display's OOTF), then a
tone curve that puts reference white (203 nits, BT.2408) near SDR white and rolls highlights
off up to 1000 nits, then sRGB's curve; one 256-entry table a channel. BT.2020 primaries are then
mapped to sRGB's by a 3x3 matrix in the coded (non-linear) domain: an approximation, and all
that Pillow can do without a float pipeline, which keeps greens and reds from looking washed out.
"""

from __future__ import annotations

import math
import struct

from PIL import Image

PQ = 16
HLG = 18
BT2020_PRIMARIES = 9
# The colour box is in `meta`, near the start; a picture's data follows.
_SEARCH_BYTES = 4 * 1024 * 1024
REFERENCE_WHITE_NITS = 203.0
PEAK_NITS = 1000.0
# Linear BT.2020 RGB -> linear BT.709/sRGB RGB (ITU-R BT.2087), as Pillow's 12-tuple.
_BT2020_TO_709 = (
    1.6605, -0.5876, -0.0728, 0.0,
    -0.1246, 1.1329, -0.0083, 0.0,
    -0.0182, -0.1006, 1.1187, 0.0,
)  # fmt: skip


def nclx(data: bytes) -> tuple[int, int, int] | None:
    """(colour primaries, transfer characteristics, matrix coefficients) of the first `nclx`
    colour box, or None."""
    at = data.find(b"colrnclx", 0, _SEARCH_BYTES)
    if at < 0 or at + 14 > len(data):
        return None
    primaries, transfer, matrix = struct.unpack_from(">HHH", data, at + 8)
    return primaries, transfer, matrix


def to_sdr(img: Image.Image, data: bytes) -> Image.Image:
    """`img` (8-bit, in the file's transfer) as sRGB when the file says PQ or HLG; else as is."""
    colour = nclx(data)
    if colour is None or colour[1] not in (PQ, HLG) or img.mode not in ("L", "LA", "RGB", "RGBA"):
        return img
    table = _table(colour[1])
    bands = len(img.getbands())
    colour_bands = 1 if img.mode in ("L", "LA") else 3
    lut = table * colour_bands + list(range(256)) * (bands - colour_bands)
    out = img.point(lut)
    if colour[0] == BT2020_PRIMARIES and colour_bands == 3:
        alpha = out.getchannel("A") if out.mode == "RGBA" else None
        out = out.convert("RGB").convert("RGB", _BT2020_TO_709)
        if alpha is not None:
            out.putalpha(alpha)
    return out


def _table(transfer: int) -> list[int]:
    return [
        round(255 * _srgb(_tone(_nits(v / 255, transfer) / REFERENCE_WHITE_NITS)))
        for v in range(256)
    ]


def _nits(signal: float, transfer: int) -> float:
    """Display light in cd/m^2 of a code value (0..1)."""
    if transfer == PQ:
        m1, m2 = 2610 / 16384, 2523 / 4096 * 128
        c1, c2, c3 = 3424 / 4096, 2413 / 4096 * 32, 2392 / 4096 * 32
        p = signal ** (1 / m2)
        return 10000.0 * (max(p - c1, 0.0) / (c2 - c3 * p)) ** (1 / m1)
    # HLG: inverse OETF to scene light, then the OOTF of a 1000-nit display (gamma 1.2).
    a, b, c = 0.17883277, 0.28466892, 0.55991073
    scene = signal * signal / 3 if signal <= 0.5 else (math.exp((signal - c) / a) + b) / 12
    return PEAK_NITS * scene**1.2


def _tone(x: float) -> float:
    """Extended Reinhard on light doubled: reference white (x = 1) lands at 0.68 (0.85 once
    sRGB-coded, where SDR pictures put paper white), the peak at exactly 1."""
    x, white = 2 * x, 2 * PEAK_NITS / REFERENCE_WHITE_NITS
    return min(1.0, x * (1 + x / (white * white)) / (1 + x)) if x > 0 else 0.0


def _srgb(linear: float) -> float:
    linear = min(max(linear, 0.0), 1.0)
    return 12.92 * linear if linear <= 0.0031308 else 1.055 * linear ** (1 / 2.4) - 0.055
