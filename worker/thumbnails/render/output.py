"""From one decoded picture to what a job records: every configured size, encoded, plus the
placeholders a page shows while those load (a ThumbHash and the dominant colour).

Every renderer decodes (or rasterises) once, at the largest size, and hands the picture here; the
smaller sizes are resampled from it, which costs a few ms against a decode's tens or hundreds.
"""

from __future__ import annotations

import base64
import functools
import io
import math
import operator
import threading
import warnings

from PIL import Image, ImageChops, ImageFilter

from worker.thumbnails.render import RenderOptions, Rendition, Thumbnail
from worker.thumbnails.render.sniff import HEIC, HEIF, IMAGE_FORMATS, MUPDF_FORMATS, OFFICE_TYPES

# Measured on a 4000x3000 photo: method 0 encodes a 512 px thumbnail in a quarter of the time of
# the default method 4 (5-7 ms against 20 ms), for files about 6% larger.
WEBP_METHOD = 0
# WebP's lossless mode stores a graphic (a text page, a diagram, a chart, a logo: a few colours on
# a background) exactly, in fewer bytes and less time than the lossy mode at quality 80 spends on
# the ringing around its edges. Measured at 512 px: a text page 24 KB in 3.2 ms against 41 KB in
# 6.6 ms, a diagram 4.7 KB in 2.4 ms against 35 KB in 6.2 ms. A photo dithered to 256 colours has
# no background and stays lossy (lossless: 39 KB in 9.6 ms against 20 KB in 5.1 ms); so does any
# picture of more colours. A grey photo on a white page looks like a graphic by its colours, but
# lossless takes 4-5 times the lossy bytes: a lossless picture over `GRAPHIC_MAX_BYTES_PER_PIXEL`
# is encoded lossy as well and the smaller kept (lossy takes about 0.2 bytes a pixel for a text
# page, 0.04-0.15 for photos; the text page above takes 0.13 lossless). Effort 0 (with method 0)
# is libwebp's fastest lossless setting; 10 gave the same bytes.
GRAPHIC_MAX_COLOURS = 256
GRAPHIC_MIN_BACKGROUND = 0.25  # a text page's white is ~80% of it, a dithered photo's top 2%
GRAPHIC_MAX_BYTES_PER_PIXEL = 0.15
WEBP_LOSSLESS_EFFORT = 0
# libavif's fastest speed: 35 ms for a 512x384 photo where speed 8 takes 76 ms and 6 takes 325 ms
# (measured), for files 8% larger. One thread: the render processes already use every core.
AVIF_SPEED = 10
# For a large reduction Pillow first shrinks by a whole factor with a box filter (an area
# average), then resamples the last `REDUCING_GAP` times or less. Measured against a full Lanczos
# resample down to 512 px: 1.0 gives 36 dB PSNR on a 1920x1080 screenshot and 43-47 dB on photos
# (1.5: 40 and 48-52 dB), all well above the ~30 dB that WebP quality 80 itself leaves, and takes
# a 1920x1080 PNG down in 6 ms instead of 9.4 ms (a third of its 19.5 ms decode; bench.formats'
# pipeline ratio counts every such ms).
REDUCING_GAP = 1.0
CONTENT_TYPES = {"webp": "image/webp", "jpeg": "image/jpeg", "avif": "image/avif"}
# The placeholders are computed from a picture this small. ThumbHash keeps at most 7 cosine terms
# a side, which 16 samples still resolve: a 512 px photo hashed from 16 px and from 32 px differed
# in one nibble of 25 bytes; the hash of 16 px costs 0.3-0.5 ms (100 px, the format's limit, costs
# twelve times as much for nothing a blurred placeholder shows).
_HASH_BOX = 16
# The dominant colour is counted over this many pixels a side of the largest picture, sampled
# (nearest neighbour): 24 x 18 of a 512 x 384 photo is about every 21st pixel; 0.2-0.4 ms.
_COLOUR_BOX = 24
# Cover crops (THUMBQ_THUMB_FIT=cover). The renderer fits the picture into a box this many times
# the square at most (a 4:1 panorama still fills its square; a longer one gives a smaller one).
COVER_MAX_ASPECT = 4.0
# Where the header cannot be read before decoding (SVG, video, an office document's embedded
# picture), the box is this many times the square: a picture up to 2:1 (16:9 video) fills it.
COVER_UNKNOWN_ASPECT = 2.0
# Saliency is scored on the picture shrunk to this many pixels along its longer side: the crop
# can only slide along that side, and 64 steps place it to within 1/64 of the picture.
_ATTENTION_SIDE = 64
# The scores, after libvips' attention crop: edges (Sobel on luma), skin tones and saturated
# colour. libvips scores in CIELAB; here in YCbCr, which Pillow converts natively in microseconds
# (an ICC transform to LAB cost 11 ms to build in each process). Skin: Cb 77-127 and Cr 133-173,
# the usual YCbCr skin cluster, with luma >= 40 (libvips: L >= 15). Saturated: chroma over 76 in
# CbCr, which is LAB's chroma 60 (libvips' threshold) for reds and oranges (measured on a few
# colours: CbCr chroma is about 1.27 times LAB's). Each mask scores 255 where true, as libvips'
# do; an edge scores its |gx| + |gy| in LAB's L units (0-100), as libvips' does.
_SKIN_CB = (77, 127)
_SKIN_CR = (133, 173)
_SKIN_MIN_Y = 40
_SATURATED_CHROMA = 76
_SOBEL_X = (-1, 0, 1, -2, 0, 2, -1, 0, 1)
_SOBEL_Y = (-1, -2, -1, 0, 0, 0, 1, 2, 1)
# Lookup tables over (Y, Cb, Cr): skin's three conditions as 0/255 masks; (v - 128)^2 / 64 of
# the chroma channels (at most 255 each, summed with clipping); that sum over the threshold.
_SKIN_LUT = [
    *(255 if y >= _SKIN_MIN_Y else 0 for y in range(256)),
    *(255 if _SKIN_CB[0] <= v <= _SKIN_CB[1] else 0 for v in range(256)),
    *(255 if _SKIN_CR[0] <= v <= _SKIN_CR[1] else 0 for v in range(256)),
]
_CHROMA_LUT = [0] * 256 + [min(255, (v - 128) ** 2 // 64) for v in range(256)] * 2
_SATURATED_LUT = [255 if v * 64 > _SATURATED_CHROMA**2 else 0 for v in range(256)]


def fit_inside(size: tuple[int, int], box: int) -> tuple[int, int] | None:
    """The size that fits `size` inside a `box` x `box` square with its aspect kept, or None when
    it already fits (an image is never enlarged)."""
    width, height = size
    if width <= box and height <= box:
        return None
    if width >= height:
        return box, max(1, round(height * box / width))
    return max(1, round(width * box / height)), box


def finish(
    img: Image.Image,
    opts: RenderOptions,
    source_type: str,
    *,
    icc_profile: bytes | None = None,
    degraded: bool = False,
    page: int = 1,
    placeholders: bool = True,
) -> Thumbnail:
    """Encode `img` (8-bit L/LA/RGB/RGBA, already fitted to the largest size) at every size of
    `opts`, each resampled from the next larger one, with the placeholders computed once (none
    without `placeholders`: a document's later pages). With `opts.fit` "cover" each size is a
    square (`cover_square`); its renditions show page `page` of a document.

    With several sizes the largest is encoded on a second thread while this one resamples and
    encodes the others and computes the placeholders: the encoders release the GIL, and the
    largest encode alone is about as long as all the rest (a 512 px slide: 3.1 ms against
    1.1 + 0.4 for 256 and 128 and 0.5 ms of placeholders, measured)."""
    img = _displayable(img)
    if opts.fit == "cover":
        img = cover_square(img, top=source_type in MUPDF_FORMATS or source_type in OFFICE_TYPES)
    sizes = sorted(opts.crop_sizes or opts.all_sizes(), reverse=True)
    pictures: list[Image.Image] = []
    current = img
    for size in sizes:
        target = fit_inside(current.size, size)
        if target is not None:
            current = current.resize(
                target,
                Image.Resampling.BILINEAR if degraded else Image.Resampling.LANCZOS,
                reducing_gap=REDUCING_GAP,
            )
        pictures.append(current)
    largest = _EncodeAside(pictures[0], opts, icc_profile) if len(pictures) > 1 else None
    try:
        encoded = [encode(p, opts, icc_profile=icc_profile) for p in pictures[1:]]
        hashed = colour = None
        if placeholders:
            small = current.copy()
            small.thumbnail((_HASH_BOX, _HASH_BOX), Image.Resampling.BOX)
            hashed = thumbhash(small.convert("RGBA"))
            # The dominant colour counts pixels of the largest picture, sampled, not averaged:
            # an average of fine detail (text, stripes, a pattern) is a colour nowhere in the
            # picture.
            sample = pictures[0].resize(
                fit_inside(pictures[0].size, _COLOUR_BOX) or pictures[0].size,
                Image.Resampling.NEAREST,
            )
            colour = dominant_color(sample.convert("RGBA"))
    except BaseException:
        if largest is not None:
            largest.wait()  # no encode outlives the render that failed
        raise
    if largest is not None:
        first = largest.result()
    else:
        first = encode(pictures[0], opts, icc_profile=icc_profile)
    encoded.insert(0, first)
    renditions = [
        Rendition(size, data, picture.width, picture.height, page)
        for size, picture, (data, _) in zip(sizes, pictures, encoded, strict=True)
    ]
    renditions.reverse()
    return Thumbnail(
        data=renditions[-1].data,
        content_type=first[1],
        width=renditions[-1].width,
        height=renditions[-1].height,
        source_type=source_type,
        renditions=tuple(renditions),
        thumbhash=hashed,
        dominant_color=colour,
        degraded=degraded,
    )


def cover_box(data: bytes, source_type: str | None, size: int) -> int:
    """The box to fit a picture into so that its shorter side fills a `size` square: from the
    header's width and height where a cheap look at it gives them."""
    try:
        if source_type in (HEIC, HEIF):
            from worker.thumbnails.render import heif

            width, height = heif.upright_size(heif.parse(data))
        elif source_type in IMAGE_FORMATS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data), formats=[IMAGE_FORMATS[source_type]]) as img:
                    width, height = img.size
        else:
            return math.ceil(size * COVER_UNKNOWN_ASPECT)
        aspect = max(width, height) / max(1, min(width, height))
    except Exception:
        # Not for this look (libheif's HEIC shapes, a damaged header): the renderer reads the
        # header again and says what is wrong with it.
        return math.ceil(size * COVER_UNKNOWN_ASPECT)
    return math.ceil(size * min(max(aspect, 1.0), COVER_MAX_ASPECT))


def cover_square(img: Image.Image, *, top: bool) -> Image.Image:
    """The largest square of `img`: the top of a page (`top`), else where the picture's most
    salient part is (`attention_offset`)."""
    width, height = img.size
    side = min(width, height)
    if width == height:
        return img
    if top:
        left = (width - side) // 2  # a landscape slide: its middle, full height
        return img.crop((left, 0, left + side, side))
    offset = attention_offset(img)
    if width > height:
        return img.crop((offset, 0, offset + side, side))
    return img.crop((0, offset, side, offset + side))


def attention_offset(img: Image.Image) -> int:
    """Where the square of `img`'s shorter side starts along its longer side so that it holds
    the most salient part: the idea of libvips' attention crop (edges, skin tones and saturated
    colour, scored on the picture shrunk to `_ATTENTION_SIDE`), with the window's score weighted
    towards its middle so that a subject ends up inside it, not on its edge. A picture with
    nothing to choose between gives the centre."""
    width, height = img.size
    landscape = width > height
    long_side, short_side = (width, height) if landscape else (height, width)
    scale = min(1.0, _ATTENTION_SIDE / long_side)
    small_size = (max(1, round(width * scale)), max(1, round(height * scale)))
    # Sampled at twice that (nearest), then averaged: on bench.crop's 200 pictures an area
    # average of the whole picture kept the subject in 180 where this kept it in 190, and took
    # 2.8 ms a picture against 1.6 (measured together, on a loaded machine).
    sampled = img.resize((2 * small_size[0], 2 * small_size[1]), Image.Resampling.NEAREST)
    small = sampled.convert("RGB").resize(small_size, Image.Resampling.BOX)
    ycc = small.convert("YCbCr")
    luma = ycc.getchannel(0)
    # |gx| and |gy| each as two clipped convolutions (a kernel and its negation); divided by 4
    # so that the largest step (4 x 255) fits a byte.
    edges = None
    for kernel in (_SOBEL_X, _SOBEL_Y):
        for sign in (1, -1):
            part = luma.filter(ImageFilter.Kernel((3, 3), [sign * k for k in kernel], scale=4))
            edges = part if edges is None else ImageChops.add(edges, part, scale=1)
    assert edges is not None
    bright, cb_skin, cr_skin = ycc.point(_SKIN_LUT).split()
    skin = ImageChops.multiply(ImageChops.multiply(bright, cb_skin), cr_skin)
    _, cb_square, cr_square = ycc.point(_CHROMA_LUT).split()
    saturated = ImageChops.add(cb_square, cr_square).point(_SATURATED_LUT)
    # One score per step along the longer side (column or row means: the window slides only
    # that way).
    profile_size = (small_size[0], 1) if landscape else (1, small_size[1])
    # An edge's |gx| + |gy| in LAB's L units: /4 undone, luma's 0-255 as L's 0-100 (the clipped
    # sum of four parts keeps 255 as its largest).
    edge_weight = 4 * 100 / 255
    profile = [
        edge_weight * e + k + t
        for e, k, t in zip(
            edges.resize(profile_size, Image.Resampling.BOX).tobytes(),
            skin.resize(profile_size, Image.Resampling.BOX).tobytes(),
            saturated.resize(profile_size, Image.Resampling.BOX).tobytes(),
            strict=True,
        )
    ]
    steps = len(profile)
    window = max(1, min(steps, round(steps * short_side / long_side)))
    sigma = window / 3
    weights = [math.exp(-(((i - (window - 1) / 2) / sigma) ** 2) / 2) for i in range(window)]
    middle = (steps - window) / 2
    best_start, best_score = 0, -1.0
    for start in range(steps - window + 1):
        score = sum(map(operator.mul, profile[start : start + window], weights))
        # Equal scores (a plain picture) go to the window nearest the centre.
        score -= 1e-6 * abs(start - middle)
        if score > best_score:
            best_start, best_score = start, score
    centre = (best_start + window / 2) / steps * long_side
    return max(0, min(long_side - short_side, round(centre - short_side / 2)))


class _EncodeAside:
    """`encode` on a thread of its own, started at once; `result()` waits for it and returns
    its value or raises its exception. Where no thread can be started (the render's memory
    limit leaves no room for its stack) the encode runs in `result()` instead."""

    def __init__(self, img: Image.Image, opts: RenderOptions, icc_profile: bytes | None) -> None:
        self._args = (img, opts, icc_profile)
        self._value: tuple[bytes, str] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(target=self._run, daemon=True)
        try:
            self._thread.start()
        except RuntimeError:
            self._thread = None

    def _run(self) -> None:
        img, opts, icc_profile = self._args
        try:
            self._value = encode(img, opts, icc_profile=icc_profile)
        except BaseException as exc:  # handed to result(), raised in the rendering thread
            self._error = exc

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def result(self) -> tuple[bytes, str]:
        if self._thread is None:
            self._run()
        else:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


def _displayable(img: Image.Image) -> Image.Image:
    if img.mode == "LA":
        img = img.convert("RGBA")
    if img.mode == "RGBA" and img.getchannel("A").getextrema()[0] == 255:
        # Fully opaque: an alpha plane would only cost bytes.
        img = img.convert("RGB")
    if img.mode not in ("RGB", "RGBA", "L"):
        img = img.convert("RGB")
    return img


def encode(
    img: Image.Image, opts: RenderOptions, *, icc_profile: bytes | None = None
) -> tuple[bytes, str]:
    """Encode an L/LA/RGB/RGBA image as `opts.format`; JPEG gets alpha flattened onto white."""
    img = _displayable(img)
    buf = io.BytesIO()
    if opts.format == "jpeg":
        if img.mode == "RGBA":
            background = Image.new("RGB", img.size, (255, 255, 255))
            background.paste(img, mask=img.getchannel("A"))
            img = background
        img.save(buf, "JPEG", quality=opts.quality, icc_profile=icc_profile)
        return buf.getvalue(), CONTENT_TYPES["jpeg"]
    if img.mode == "L":
        img = img.convert("RGB")
    if opts.format == "webp":
        lossless = None
        if is_graphic(img):
            img.save(
                buf,
                "WEBP",
                lossless=True,
                quality=WEBP_LOSSLESS_EFFORT,
                method=WEBP_METHOD,
                icc_profile=icc_profile,
            )
            lossless, buf = buf.getvalue(), io.BytesIO()
            if len(lossless) <= GRAPHIC_MAX_BYTES_PER_PIXEL * img.width * img.height:
                return lossless, CONTENT_TYPES["webp"]
            # A photo's gradients on a plain background: lossy may well be smaller.
        img.save(buf, "WEBP", quality=opts.quality, method=WEBP_METHOD, icc_profile=icc_profile)
        lossy = buf.getvalue()
        if lossless is not None and len(lossless) < len(lossy):
            return lossless, CONTENT_TYPES["webp"]
        return lossy, CONTENT_TYPES["webp"]
    if opts.format == "avif":
        img.save(
            buf,
            "AVIF",
            quality=opts.quality,
            speed=AVIF_SPEED,
            max_threads=1,
            icc_profile=icc_profile,
        )
        return buf.getvalue(), CONTENT_TYPES["avif"]
    raise ValueError(f"unknown thumbnail format {opts.format!r}")


@functools.lru_cache(maxsize=256)
def _cosines(size: int, count: int) -> tuple[tuple[float, ...], ...]:
    """cos(pi / size * k * (i + 0.5)) for k < count and i < size: a DCT's basis, computed once
    per picture size (the placeholders' pictures come in a few sizes)."""
    return tuple(
        tuple(math.cos(math.pi / size * k * (i + 0.5)) for i in range(size)) for k in range(count)
    )


def is_graphic(img: Image.Image) -> bool:
    """Whether `img` is a graphic rather than a photo: a few colours (at most
    `GRAPHIC_MAX_COLOURS`), one of them a background (at least `GRAPHIC_MIN_BACKGROUND` of the
    pixels). A photo gives up counting at its 257th colour, within its first rows."""
    colours = img.getcolors(GRAPHIC_MAX_COLOURS)
    if not colours:
        return False
    return max(colours)[0] >= GRAPHIC_MIN_BACKGROUND * img.width * img.height


def dominant_color(rgba: Image.Image) -> str:
    """The most common colour of the picture's visible pixels, as #rrggbb: a median-cut palette of
    five colours, the largest bucket wins (an average would give grey for a red-and-blue flag)."""
    alpha = rgba.getchannel("A")
    rgb = rgba.convert("RGB")
    low, _high = alpha.getextrema()
    if isinstance(low, int) and low < 255:
        # Transparent pixels carry no colour a viewer sees; drop them.
        raw = rgba.tobytes()
        visible = b"".join(raw[i : i + 3] for i in range(0, len(raw), 4) if raw[i + 3] >= 128)
        if not visible:
            return "#ffffff"
        rgb = Image.frombytes("RGB", (len(visible) // 3, 1), visible)
    palette_img = rgb.quantize(colors=5, method=Image.Quantize.MEDIANCUT)
    palette = palette_img.getpalette() or [255, 255, 255]
    counts = palette_img.getcolors() or [(1, 0)]
    _count, index = max(counts)
    assert isinstance(index, int)
    r, g, b = palette[3 * index : 3 * index + 3]
    return f"#{r:02x}{g:02x}{b:02x}"


def thumbhash(rgba: Image.Image) -> str:
    """The ThumbHash of an RGBA picture of at most 100x100 px, base64-encoded (the form browsers'
    decoders take). Follows the format's published algorithm: a DCT of luminance, two chroma
    channels and alpha, quantised into about 25 bytes."""
    w, h = rgba.size
    if w > 100 or h > 100:
        raise ValueError(f"{w}x{h} does not fit in 100x100")
    raw = rgba.tobytes()
    n = w * h
    reds, greens, blues, alpha_bytes = raw[0::4], raw[1::4], raw[2::4], raw[3::4]
    has_alpha = alpha_bytes.count(255) != n
    alphas = [a / 255 for a in alpha_bytes] if has_alpha else []
    if has_alpha:
        # Composite atop the average colour of the visible pixels.
        avg_a = sum(alphas)
        avg_r = avg_g = avg_b = 0.0
        if avg_a:
            avg_r = sum(map(operator.mul, alphas, reds)) / 255 / avg_a
            avg_g = sum(map(operator.mul, alphas, greens)) / 255 / avg_a
            avg_b = sum(map(operator.mul, alphas, blues)) / 255 / avg_a
        rs = [avg_r * (1 - a) + a / 255 * r for a, r in zip(alphas, reds, strict=True)]
        gs = [avg_g * (1 - a) + a / 255 * g for a, g in zip(alphas, greens, strict=True)]
        bs = [avg_b * (1 - a) + a / 255 * b for a, b in zip(alphas, blues, strict=True)]
    else:
        # Opaque (most thumbnails): the same values as the composite with alpha 1, cheaper.
        k = 1 / 255
        rs = [k * r for r in reds]
        gs = [k * g for g in greens]
        bs = [k * b for b in blues]
    l_limit = 5 if has_alpha else 7  # fewer luminance terms leave room for alpha
    lx = max(1, round(l_limit * w / max(w, h)))
    ly = max(1, round(l_limit * h / max(w, h)))
    # Luminance and two opponent channels.
    lum = [(r + g + b) / 3 for r, g, b in zip(rs, gs, bs, strict=True)]
    p_ch = [(r + g) / 2 - b for r, g, b in zip(rs, gs, bs, strict=True)]
    q_ch = [r - g for r, g in zip(rs, gs, strict=True)]
    a_ch = alphas

    def encode_channel(channel: list[float], nx: int, ny: int) -> tuple[float, list[float], float]:
        dc = 0.0
        ac: list[float] = []
        scale = 0.0
        cos_x, cos_y = _cosines(w, nx), _cosines(h, ny)
        columns = [channel[x::w] for x in range(w)]
        for cy in range(ny):
            # Separable: weight each column by the vertical cosine once, then the horizontal.
            column = [sum(map(operator.mul, values, cos_y[cy])) for values in columns]
            cx = 0
            while cx * ny < nx * (ny - cy):
                f = sum(map(operator.mul, column, cos_x[cx])) / n
                if cx or cy:
                    ac.append(f)
                    scale = max(scale, abs(f))
                else:
                    dc = f
                cx += 1
        if scale:
            ac = [0.5 + 0.5 / scale * f for f in ac]
        return dc, ac, scale

    l_dc, l_ac, l_scale = encode_channel(lum, max(3, lx), max(3, ly))
    p_dc, p_ac, p_scale = encode_channel(p_ch, 3, 3)
    q_dc, q_ac, q_scale = encode_channel(q_ch, 3, 3)
    landscape = w > h
    header24 = (
        round(63 * l_dc)
        | (round(31.5 + 31.5 * p_dc) << 6)
        | (round(31.5 + 31.5 * q_dc) << 12)
        | (round(31 * l_scale) << 18)
        | (int(has_alpha) << 23)
    )
    header16 = (
        (ly if landscape else lx)
        | (round(63 * p_scale) << 3)
        | (round(63 * q_scale) << 9)
        | (int(landscape) << 15)
    )
    out = [header24 & 255, (header24 >> 8) & 255, header24 >> 16, header16 & 255, header16 >> 8]
    channels = [l_ac, p_ac, q_ac]
    if has_alpha:
        a_dc, a_ac, a_scale = encode_channel(a_ch, 5, 5)
        out.append(round(15 * a_dc) | (round(15 * a_scale) << 4))
        channels.append(a_ac)
    start = len(out)
    index = 0
    for ac in channels:
        for f in ac:
            pos = start + (index >> 1)
            while len(out) <= pos:
                out.append(0)
            out[pos] |= round(15 * f) << ((index & 1) << 2)
            index += 1
    return base64.b64encode(bytes(out)).decode("ascii")
