"""Raster images (JPEG, PNG, GIF, WebP, TIFF, BMP) to thumbnails with Pillow.

The pixel count is checked from the header before anything is decoded; JPEGs are decoded at
reduced scale by libjpeg itself; every mode Pillow can produce is brought to 8-bit L/RGB(A).
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib

from PIL import (
    BmpImagePlugin,
    ExifTags,
    GifImagePlugin,
    Image,
    ImageOps,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
    UnidentifiedImageError,
    WebPImagePlugin,
)

from worker.errors import CORRUPT_INPUT, TOO_LARGE, UNSUPPORTED_TYPE, ThumbqError
from worker.render import RenderOptions, Thumbnail
from worker.render.sniff import IMAGE_FORMATS, sniff

# Importing the plugins registers them; otherwise the first open or save of a format outside
# Pillow's five preloaded ones imports all ~40 plugins, about 40 ms in every new process.
_PLUGINS = (
    BmpImagePlugin,
    GifImagePlugin,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
    WebPImagePlugin,
)
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
# Measured on a 4000x3000 photo: method 0 encodes a 512 px thumbnail in a quarter of the time of
# the default method 4 (5-7 ms against 20 ms), for files about 6% larger.
WEBP_METHOD = 0
# For a large reduction Pillow first shrinks by a whole factor with a box filter, then resamples
# the last `REDUCING_GAP` times or less. Measured on photos from 1600x1200 and 3000x2000 down to
# 512 px: 1.5 makes Lanczos 3-5x faster (10-16 ms instead of 28-91 ms), 44-49 dB PSNR against a
# full Lanczos resample, well above the ~30 dB that WebP quality 80 itself leaves.
REDUCING_GAP = 1.5


def render_image(data: bytes, opts: RenderOptions) -> Thumbnail:
    """Decode a raster image at the smallest scale that still fills the box and encode a thumbnail.

    A smaller image is never upscaled; EXIF orientation is applied; an animation gives its first
    frame.
    """
    source_type = sniff(data)
    img, full_size, draft_box = _open(data, source_type, opts.size, opts.max_pixels)
    source_mode = img.mode
    icc_profile = img.info.get("icc_profile") if source_mode in ("RGB", "RGBA") else None
    img = _normalise_mode(img)
    # Rotating by EXIF orientation swaps width and height, which cannot change whether an image
    # fits a square box; so fit first and rotate the small result, which is much cheaper.
    target = fit_inside(full_size, opts.size)
    if target is not None and img.size != target:
        if draft_box is not None and max(img.size) < 2 * max(target):
            # libjpeg already shrank in the DCT domain (a proper low-pass); the step left is under
            # 2x, and bilinear does it in half the time of Lanczos. Against a full-decode Lanczos
            # reference the final WebP differs by 0.25 dB PSNR (30.24 vs 30.49 dB, measured).
            img = img.resize(target, Image.Resampling.BILINEAR, box=draft_box)
        else:
            img = img.resize(
                target, Image.Resampling.LANCZOS, box=draft_box, reducing_gap=REDUCING_GAP
            )
    img = _apply_orientation(img)
    img = _to_display_mode(img, sixteen_bit=source_mode.startswith("I;16"))
    encoded, content_type = encode(img, opts, icc_profile=icc_profile)
    return Thumbnail(
        data=encoded,
        content_type=content_type,
        width=img.width,
        height=img.height,
        source_type=source_type or "application/octet-stream",
    )


def fit_inside(size: tuple[int, int], box: int) -> tuple[int, int] | None:
    """The size that fits `size` inside a `box` x `box` square with its aspect kept, or None when
    it already fits (an image is never enlarged)."""
    width, height = size
    if width <= box and height <= box:
        return None
    if width >= height:
        return box, max(1, round(height * box / width))
    return max(1, round(width * box / height)), box


def encode(
    img: Image.Image, opts: RenderOptions, *, icc_profile: bytes | None = None
) -> tuple[bytes, str]:
    """Encode an L/LA/RGB/RGBA image as `opts.format`; JPEG gets alpha flattened onto white."""
    if img.mode == "LA":
        img = img.convert("RGBA")
    if img.mode == "RGBA" and img.getchannel("A").getextrema()[0] == 255:
        # Fully opaque: an alpha plane would only cost bytes.
        img = img.convert("RGB")
    buf = io.BytesIO()
    if opts.format == "jpeg":
        if img.mode == "RGBA":
            background = Image.new("RGB", img.size, (255, 255, 255))
            background.paste(img, mask=img.getchannel("A"))
            img = background
        elif img.mode not in ("RGB", "L"):
            img = img.convert("RGB")
        img.save(buf, "JPEG", quality=opts.quality, icc_profile=icc_profile)
        return buf.getvalue(), "image/jpeg"
    if opts.format != "webp":
        raise ValueError(f"unknown thumbnail format {opts.format!r}")
    if img.mode not in ("RGB", "RGBA"):
        img = img.convert("RGB")
    img.save(buf, "WEBP", quality=opts.quality, method=WEBP_METHOD, icc_profile=icc_profile)
    return buf.getvalue(), "image/webp"


def _open(
    data: bytes, source_type: str | None, box: int, max_pixels: int
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
    except _DECODE_ERRORS as exc:
        raise ThumbqError(CORRUPT_INPUT, f"{source_type} file is damaged: {exc}") from None

    width, height = img.size
    if width <= 0 or height <= 0:
        raise ThumbqError(CORRUPT_INPUT, f"{source_type} declares an empty size {width}x{height}")
    if width * height > max_pixels:
        raise ThumbqError(
            TOO_LARGE,
            f"image is {width}x{height} = {width * height:,} pixels, "
            f"over the limit of {max_pixels:,}",
        )
    draft_box = None
    target = fit_inside((width, height), box)
    if img.format == "JPEG" and target is not None:
        # libjpeg scales while decoding by 1/2, 1/4 or 1/8: the largest reduction that stays at
        # least as big as the fitted size (not the square box: a 1024x768 photo decodes straight
        # to 512x384), so the resize afterwards never enlarges and is often not needed.
        drafted = img.draft("RGB", target)
        if drafted is not None and img.size != (width, height):
            draft_box = drafted[1]
    try:
        img.load()
    except Image.DecompressionBombError as exc:
        raise ThumbqError(TOO_LARGE, f"image is too large to decode safely: {exc}") from None
    except _DECODE_ERRORS as exc:
        raise ThumbqError(CORRUPT_INPUT, f"{source_type} file is damaged: {_reason(exc)}") from None
    return img, (width, height), draft_box


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
