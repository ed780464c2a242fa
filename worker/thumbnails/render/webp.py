"""A still WebP decoded straight to its thumbnail's size by libwebp's own scaler.

Pillow decodes a WebP whole (a 6 MP photo: 24 MB of RGBA, about 80 ms) and leaves the shrinking
to a resize. libwebp can write its output through an area-averaging rescaler while it converts
YUV to RGB (`WebPDecoderOptions.use_scaling`), as libvips' shrink-on-load does; Pillow does not
expose that, so this calls the libwebp that Pillow's wheel ships (or the system's) through ctypes.
Layouts below are those of libwebp's `decode.h` at decoder ABI 0x0209; the library refuses a
config from an incompatible ABI (`WebPInitDecoderConfigInternal` returns 0), and then, or where
no libwebp is found, `decode_scaled` answers None and Pillow decodes as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os

from PIL import Image

_ABI = 0x0209
_MODE_RGB, _MODE_RGBA = 0, 1
_VP8_STATUS_OK = 0


class _Features(ctypes.Structure):
    _fields_ = [
        ("width", ctypes.c_int),
        ("height", ctypes.c_int),
        ("has_alpha", ctypes.c_int),
        ("has_animation", ctypes.c_int),
        ("format", ctypes.c_int),
        ("pad", ctypes.c_uint32 * 5),
    ]


class _RGBABuffer(ctypes.Structure):
    _fields_ = [
        ("rgba", ctypes.c_void_p),
        ("stride", ctypes.c_int),
        ("size", ctypes.c_size_t),
    ]


class _YUVABuffer(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("y", "u", "v", "a")),
        *((name, ctypes.c_int) for name in ("y_stride", "u_stride", "v_stride", "a_stride")),
        *((name, ctypes.c_size_t) for name in ("y_size", "u_size", "v_size", "a_size")),
    ]


class _Planes(ctypes.Union):
    _fields_ = [("RGBA", _RGBABuffer), ("YUVA", _YUVABuffer)]


class _DecBuffer(ctypes.Structure):
    _fields_ = [
        ("colorspace", ctypes.c_int),
        ("width", ctypes.c_int),
        ("height", ctypes.c_int),
        ("is_external_memory", ctypes.c_int),
        ("u", _Planes),
        ("pad", ctypes.c_uint32 * 4),
        ("private_memory", ctypes.c_void_p),
    ]


class _Options(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_int)
            for name in (
                "bypass_filtering",
                "no_fancy_upsampling",
                "use_cropping",
                "crop_left",
                "crop_top",
                "crop_width",
                "crop_height",
                "use_scaling",
                "scaled_width",
                "scaled_height",
                "use_threads",
                "dithering_strength",
                "flip",
                "alpha_dithering_strength",
            )
        ),
        ("pad", ctypes.c_uint32 * 5),
    ]


class _Config(ctypes.Structure):
    _fields_ = [("input", _Features), ("output", _DecBuffer), ("options", _Options)]


def _candidates() -> list[str]:
    """Pillow's own libwebp first (the one its WebP plugin uses), then the system's."""
    import PIL

    wheel_libs = os.path.join(os.path.dirname(PIL.__file__), os.pardir, "pillow.libs")
    found = sorted(glob.glob(os.path.join(wheel_libs, "libwebp-*.so*")))
    system = ctypes.util.find_library("webp")
    return [*found, *([system] if system else [])]


@functools.cache
def _library() -> ctypes.CDLL | None:
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            init = lib.WebPInitDecoderConfigInternal
            decode = lib.WebPDecode
            free = lib.WebPFreeDecBuffer
        except (OSError, AttributeError):
            continue
        init.argtypes, init.restype = [ctypes.POINTER(_Config), ctypes.c_int], ctypes.c_int
        decode.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(_Config)]
        decode.restype = ctypes.c_int
        free.argtypes, free.restype = [ctypes.POINTER(_DecBuffer)], None
        probe = _Config()
        if init(ctypes.byref(probe), _ABI):
            return lib
    return None


def available() -> bool:
    return _library() is not None


def decode_scaled(data: bytes, size: tuple[int, int], *, alpha: bool) -> Image.Image | None:
    """The still WebP in `data` decoded to `size` (RGBA with `alpha`, else RGB), or None where
    libwebp is not at hand or refuses the file (Pillow then decodes it, and names the damage).

    The caller has read the header (Pillow's open), checked the pixel count, and knows the file
    is not animated."""
    lib = _library()
    if lib is None:
        return None
    config = _Config()
    if not lib.WebPInitDecoderConfigInternal(ctypes.byref(config), _ABI):
        return None
    config.options.use_scaling = 1
    config.options.scaled_width, config.options.scaled_height = size
    config.output.colorspace = _MODE_RGBA if alpha else _MODE_RGB
    if lib.WebPDecode(data, len(data), ctypes.byref(config)) != _VP8_STATUS_OK:
        lib.WebPFreeDecBuffer(ctypes.byref(config.output))
        return None
    try:
        out = config.output
        planes = out.u.RGBA
        mode = "RGBA" if alpha else "RGB"
        pixels = ctypes.string_at(planes.rgba, planes.size)
        return Image.frombytes(mode, (out.width, out.height), pixels, "raw", mode, planes.stride)
    finally:
        lib.WebPFreeDecBuffer(ctypes.byref(config.output))
