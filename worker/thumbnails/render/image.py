"""Raster images (JPEG, PNG, GIF, WebP, TIFF, BMP, HEIC/HEIF, AVIF, PSD, ICO, CUR) to thumbnails
with Pillow (and pillow-heif for HEIC). An icon or cursor gives its largest image.

The pixel count is checked from the header before anything is decoded; JPEGs are decoded at
reduced scale by libjpeg itself; every mode Pillow can produce is brought to 8-bit L/RGB(A). A
Photoshop file gives its composite (the flattened image Photoshop stores beside the layers).
"""

from __future__ import annotations

import io
import os
import struct
import warnings
import zlib

from PIL import (
    AvifImagePlugin,
    BmpImagePlugin,
    ExifTags,
    GifImagePlugin,
    IcoImagePlugin,
    Image,
    ImageOps,
    JpegImagePlugin,
    PngImagePlugin,
    PsdImagePlugin,
    TiffImagePlugin,
    UnidentifiedImageError,
    WebPImagePlugin,
)

from worker.engine.errors import CORRUPT_INPUT, TOO_LARGE, UNSUPPORTED_TYPE, ThumbqError
from worker.thumbnails.render import RenderOptions, Thumbnail, png, webp
from worker.thumbnails.render.output import REDUCING_GAP, encode, finish, fit_inside
from worker.thumbnails.render.sniff import AVIF, CUR, HEIC, HEIF, IMAGE_FORMATS, sniff

__all__ = ["decode_outside_pillow", "encode", "fit_inside", "open_image", "render_image"]

# Importing the plugins registers them; otherwise the first open or save of a format outside
# Pillow's five preloaded ones imports all ~40 plugins, about 40 ms in every new process.
_PLUGINS = (
    AvifImagePlugin,
    BmpImagePlugin,
    GifImagePlugin,
    IcoImagePlugin,
    JpegImagePlugin,
    PngImagePlugin,
    PsdImagePlugin,
    TiffImagePlugin,
    WebPImagePlugin,
)
# FFmpeg's threads for one HEIC (tiles side by side, or one picture's rows): a 12 MP picture
# took 417 ms on one thread and 230 ms on two here; libheif's default is four.
HEIC_THREADS = min(4, os.cpu_count() or 1)
# What Pillow raises for data that is malformed rather than for a fault in this code.
_DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    IndexError,
    KeyError,
    struct.error,
    zlib.error,
)
_OPEN_ERRORS: tuple[type[BaseException], ...] = (*_DECODE_ERRORS, RuntimeError)


def render_image(data: bytes, opts: RenderOptions) -> Thumbnail:
    """Decode a raster image at the smallest scale that still fills the box and encode a thumbnail
    of every size.

    A smaller image is never upscaled; EXIF orientation is applied; an animation gives its first
    frame.
    """
    source_type = sniff(data) or "application/octet-stream"
    img, icc_profile = open_image(data, source_type, opts)
    return finish(img, opts, source_type, icc_profile=icc_profile, degraded=opts.degraded)


def open_image(
    data: bytes, source_type: str, opts: RenderOptions
) -> tuple[Image.Image, bytes | None]:
    """Decode and fit inside the largest box, upright, in an 8-bit display mode; returns the
    picture and the ICC profile to embed in its thumbnails."""
    img, full_size, draft_box = _open(data, source_type, opts)
    source_mode = img.mode
    icc_profile = img.info.get("icc_profile") if source_mode in ("RGB", "RGBA") else None
    img = _normalise_mode(img)
    # Rotating by EXIF orientation swaps width and height, which cannot change whether an image
    # fits a square box; so fit first and rotate the small result, which is much cheaper.
    target = fit_inside(full_size, opts.size)
    if target is not None and img.size != target:
        if opts.degraded:
            img = img.resize(target, Image.Resampling.NEAREST, box=draft_box)
        elif (
            draft_box is not None
            and max(img.size) < 2 * max(target)
            and source_type not in (HEIC, HEIF)
        ):
            # libjpeg already shrank in the DCT domain (a proper low-pass); the step left is under
            # 2x, and an area average (box) does it in 2.9 ms where bilinear takes 4.4 and
            # Lanczos more (12 MP photo, 1000x750 -> 512x384): 40.0 dB PSNR against a full
            # decode + Lanczos (bilinear: 42.6), well above the ~30 dB WebP quality 80 leaves.
            img = img.resize(target, Image.Resampling.BOX, box=draft_box)
        else:
            # A HEIC shrunk while decoding ends with Lanczos too: after FFmpeg's area average a
            # box step cost 0.5 dB of the delivered WebP (32.4 against 32.9 dB from a full decode
            # + Lanczos, 12 MP photo); Lanczos gave 32.9.
            img = img.resize(
                target, Image.Resampling.LANCZOS, box=draft_box, reducing_gap=REDUCING_GAP
            )
    if source_type in (AVIF, HEIC, HEIF):
        from worker.thumbnails.render.hdr import to_sdr

        img = to_sdr(img, data)
    if source_type not in (HEIC, HEIF):
        # libheif already applied the file's rotation and mirroring (its irot/imir boxes, which
        # HEIF says win over EXIF); applying EXIF's as well would turn the picture twice.
        img = _apply_orientation(img)
    img = _to_display_mode(img, sixteen_bit=source_mode.startswith("I;16"))
    return img, icc_profile


def _open(
    data: bytes, source_type: str | None, opts: RenderOptions
) -> tuple[Image.Image, tuple[int, int], tuple[float, float, float, float] | None]:
    """Open, check the pixel count from the header, then decode (at reduced scale for JPEG).

    Returns the image, its full size, and for a reduced-scale decode the region of the decoded
    pixels that holds the picture (the last row and column may be partly padding).
    """
    pil_format = IMAGE_FORMATS.get(source_type or "")
    if pil_format is None:
        raise ThumbqError(
            UNSUPPORTED_TYPE,
            f"not an image type thumbq renders (detected {source_type or 'unknown'})",
        )
    if source_type in (HEIC, HEIF):
        fast = open_heic(data, source_type, opts)
        if fast is not None:
            return fast
    if pil_format == "HEIF":
        _register_heif()
    if source_type == CUR:
        data = cursor_as_icon(data)
    try:
        with warnings.catch_warnings():
            # Our own limit, checked below before any decoding, refuses everything Pillow would
            # warn about; its warning would only add noise to stderr.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[pil_format])
    except Image.DecompressionBombError as exc:
        raise ThumbqError(TOO_LARGE, f"image is too large to decode safely: {exc}") from None
    except UnidentifiedImageError:
        # The magic bytes said this format, so a reader that cannot parse the header means damage.
        raise ThumbqError(
            CORRUPT_INPUT, f"{source_type} file is damaged: its header cannot be read"
        ) from None
    except _OPEN_ERRORS as exc:
        # libavif reports a malformed container as RuntimeError ("Missing or empty image item").
        raise _damaged(source_type, exc) from None

    width, height = img.size
    if width <= 0 or height <= 0:
        raise ThumbqError(CORRUPT_INPUT, f"{source_type} declares an empty size {width}x{height}")
    _check_pixels(width, height, opts)
    draft_box = None
    target = fit_inside((width, height), opts.size)
    if img.format == "JPEG" and target is not None:
        # libjpeg scales while decoding by 1/2, 1/4 or 1/8: the largest reduction that stays at
        # least as big as the fitted size (not the square box: a 1024x768 photo decodes straight
        # to 512x384), so the resize afterwards never enlarges and is often not needed. Degraded:
        # always 1/8, the cheapest decode.
        drafted = img.draft("RGB", (1, 1) if opts.degraded else target)
        if drafted is not None and img.size != (width, height):
            draft_box = drafted[1]
    decoded = decode_outside_pillow(img, data, target)
    if decoded is not None:
        return decoded, (width, height), None
    try:
        img.load()
    except Image.DecompressionBombError as exc:
        raise ThumbqError(TOO_LARGE, f"image is too large to decode safely: {exc}") from None
    except _DECODE_ERRORS as exc:
        raise _damaged(source_type, exc) from None
    except RuntimeError as exc:
        # libavif decoded the picture but cannot convert its YUV to RGB: a matrix it does not
        # implement (BT.2020 constant luminance, ICtCp, YCgCo at 10 bits), common in HDR files.
        if source_type != AVIF:
            raise _damaged(source_type, exc) from None
        return _avif_through_ffmpeg(data, source_type), (width, height), draft_box
    return img, (width, height), draft_box


def decode_outside_pillow(
    header: Image.Image, data: bytes, target: tuple[int, int] | None
) -> Image.Image | None:
    """The picture of `data` (opened by Pillow as `header`, not yet loaded) from a faster decoder
    where one applies, with `header`'s info (EXIF orientation, ICC profile); else None.

    A still WebP comes from libwebp's scaler at `target` (render/webp.py): 6 MP to 512 px in
    about 55 ms of CPU where a whole decode takes 83 and the resize comes on top. An 8-bit
    RGB(A) PNG comes whole from libspng (render/png.py)."""
    if header.format == "WEBP" and target is not None and not getattr(header, "is_animated", False):
        scaled = webp.decode_scaled(data, target, alpha=header.mode == "RGBA")
        if scaled is not None:
            scaled.info.update(header.info)
        return scaled
    if header.format == "PNG":
        return png.decode(data, header)
    return None


# nclx matrix_coefficients FFmpeg's scaler converts from; any other is read as BT.2020's
# non-constant-luminance matrix (HDR files) or BT.709's.
_SWSCALE_MATRICES = frozenset({1, 4, 5, 6, 7, 9})


def _avif_through_ffmpeg(data: bytes, source_type: str) -> Image.Image:
    """The AVIF's picture decoded by FFmpeg (dav1d) and converted by its scaler, for the files
    whose YUV libavif cannot convert."""
    import av

    try:
        with av.open(io.BytesIO(data), "r") as container:
            frame = next(container.decode(video=0))
            if frame.colorspace not in _SWSCALE_MATRICES:
                frame.colorspace = 9 if frame.colorspace in (10, 14) else 1
            return frame.to_image()
    except (av.FFmpegError, StopIteration, ValueError, OSError) as exc:
        raise _damaged(source_type, exc) from None


def open_heic(
    data: bytes, source_type: str, opts: RenderOptions
) -> tuple[Image.Image, tuple[int, int], tuple[float, float, float, float] | None] | None:
    """The common HEIC shapes through FFmpeg's decoder (`worker.thumbnails.render.heif`), shrunk
    as they are decoded; None for anything else, which libheif decodes."""
    from worker.thumbnails.render import heif

    try:
        pic = heif.parse(data)
    except heif.NotForUs:
        return None
    width, height = heif.upright_size(pic)
    _check_pixels(width, height, opts)
    try:
        img, factor = heif.decode(pic, fit_inside((width, height), opts.size), HEIC_THREADS)
    except heif.NotForUs:
        return None
    except ModuleNotFoundError as exc:
        if exc.name != "av":
            raise
        return None  # no PyAV (the `video` extra): libheif decodes every HEIC, at full size
    draft_box = None
    if factor > 1:
        # The last row and column of shrunk pixels may be partly beyond the picture's edge.
        draft_box = (0.0, 0.0, width / factor, height / factor)
    return img, (width, height), draft_box


def cursor_as_icon(data: bytes) -> bytes:
    """A cursor as the icon it is laid out like: its directory's type 2 becomes 1 and each
    entry's hotspot (where an icon keeps planes and bit depth) is cleared.

    Pillow's own cursor reader takes one picture by a comparison that ranks a 256-pixel entry
    (stored as width 0) below a 16-pixel one, and cannot read PNG entries; its icon reader picks
    the largest and reads both kinds."""
    count = int.from_bytes(data[4:6], "little")
    out = bytearray(data)
    out[2] = 1
    for i in range(count):
        entry = 6 + 16 * i
        if entry + 16 > len(out):
            break
        out[entry + 4 : entry + 8] = b"\x00\x00\x00\x00"
    return bytes(out)


def _check_pixels(width: int, height: int, opts: RenderOptions) -> None:
    """Refuse a picture whose header declares more pixels than the limit, before decoding."""
    if width * height > opts.max_pixels:
        raise ThumbqError(
            TOO_LARGE,
            f"image is {width}x{height} = {width * height:,} pixels, "
            f"over the limit of {opts.max_pixels:,}",
        )


def _register_heif() -> None:
    """Teach Pillow HEIC/HEIF, on first use: pillow-heif takes about 150 ms to import."""
    import pillow_heif

    if "HEIF" not in Image.OPEN:
        pillow_heif.register_heif_opener(thumbnails=False, depth_images=False, aux_images=False)


def _damaged(source_type: str | None, exc: BaseException) -> ThumbqError:
    reason = _reason(exc)
    if "security limit" in reason.lower():
        # libheif refuses sizes and counts (pixels, tiles, items) beyond its safety limits
        # before it decodes anything: the file is hostile or far too large, not damaged.
        return ThumbqError(TOO_LARGE, f"{source_type} exceeds libheif's safety limits: {reason}")
    if "memory allocation" in reason.lower():
        # libheif could not allocate its planes under the render's memory limit (a 33 MP 10-bit
        # HEIC at 320 MB): the picture is too large to render here, it is not damaged.
        return ThumbqError(
            TOO_LARGE, f"{source_type} needs more memory to decode than a render may use: {reason}"
        )
    return ThumbqError(CORRUPT_INPUT, f"{source_type} file is damaged: {reason}")


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text[:200]


def _normalise_mode(img: Image.Image) -> Image.Image:
    """Bring modes that resize badly or not at all to one that resamples correctly."""
    mode = img.mode
    if mode in ("P", "PA"):
        # Resizing a palette image uses nearest-neighbour; expand to true colour first.
        return img.convert("RGBA" if img.has_transparency_data else "RGB")
    if mode in ("L", "RGB") and "transparency" in img.info:
        return img.convert("RGBA")
    if mode == "1":
        return img.convert("L")
    if mode in ("La", "RGBa"):
        return img.convert({"La": "LA", "RGBa": "RGBA"}[mode])
    if mode.startswith("I;16"):
        # Pillow's reduce() and some resamplers take no 16-bit modes; 32-bit "I" is exact.
        return img.convert("I")
    if mode in ("L", "LA", "RGB", "RGBA", "CMYK", "I", "F"):
        return img
    try:
        return img.convert("RGBA" if img.has_transparency_data else "RGB")
    except ValueError as exc:
        raise ThumbqError(UNSUPPORTED_TYPE, f"image mode {mode} is not supported: {exc}") from None


def _to_display_mode(img: Image.Image, *, sixteen_bit: bool) -> Image.Image:
    """Convert the (already small) image to 8-bit L/LA/RGB/RGBA with its tones kept."""
    mode = img.mode
    if mode == "CMYK":
        return _cmyk_to_rgb(img)
    if mode in ("I", "F"):
        return _to_8bit_grey(img, sixteen_bit=sixteen_bit)
    return img


def _to_8bit_grey(img: Image.Image, *, sixteen_bit: bool) -> Image.Image:
    """Scale a 16-bit, 32-bit or float grey image into 0..255 instead of clipping it."""
    low, high = img.getextrema()
    assert isinstance(low, (int, float)) and isinstance(high, (int, float))
    if sixteen_bit or (low >= 0 and 255 < high <= 65535):
        scale, offset = 255 / 65535, 0.0
    elif img.mode == "F" and low >= 0 and high <= 1:
        scale, offset = 255.0, 0.0
    elif low >= 0 and high <= 255:
        scale, offset = 1.0, 0.0
    else:
        scale = 255 / (high - low) if high > low else 1.0
        offset = -low * scale
    return img.point(lambda v: v * scale + offset).convert("L")


def _cmyk_to_rgb(img: Image.Image) -> Image.Image:
    """Convert CMYK through its embedded ICC profile when there is one, else Pillow's formula."""
    profile = img.info.get("icc_profile")
    if profile:
        try:
            from PIL import ImageCms

            source = ImageCms.ImageCmsProfile(io.BytesIO(profile))
            srgb = ImageCms.createProfile("sRGB")
            converted = ImageCms.profileToProfile(img, source, srgb, outputMode="RGB")
            if converted is not None:
                return converted
        except (ImageCms.PyCMSError, OSError, ValueError):
            # A broken or mismatched profile is common in the wild; fall back to the formula.
            pass
    return img.convert("RGB")


def _apply_orientation(img: Image.Image) -> Image.Image:
    """Rotate/flip as the EXIF orientation tag says; a damaged EXIF block leaves the image as is."""
    try:
        if img.getexif().get(ExifTags.Base.Orientation, 1) == 1 and "xmp" not in img.info:
            return img
        transposed = ImageOps.exif_transpose(img)
    except _DECODE_ERRORS:
        return img
    return transposed if transposed is not None else img
