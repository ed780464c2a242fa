"""Video (MP4, MOV, WebM, MKV) to a thumbnail of one representative frame, with PyAV (FFmpeg).

Only keyframes are decoded: seek to about 10% of the duration, then take the first keyframe that
is not black (fade-ins and title cards are common). FFmpeg scales the frame straight to the
largest box, so no full-size RGB picture is ever made. The frame size is checked against the
pixel limit from the stream's header, before anything is decoded.
"""

from __future__ import annotations

import io

from PIL import Image, ImageStat

from worker.engine.errors import CORRUPT_INPUT, TOO_LARGE, UNSUPPORTED_TYPE, ThumbqError
from worker.thumbnails.render import RenderOptions, Thumbnail
from worker.thumbnails.render.output import finish, fit_inside
from worker.thumbnails.render.sniff import MKV, WEBM

# Where in the video to look first (a fraction of its duration).
SEEK_FRACTION = 0.10
# How many keyframes to try for one that is not black before taking the brightest seen.
MAX_KEYFRAMES = 12
# When every keyframe tried was black (a video with one keyframe, at its black start), frames
# after it are decoded, up to this many, for the first that is not.
MAX_FRAMES = 150
# A frame is "black" when its mean luminance and its spread are both this low (0-255).
BLACK_MEAN = 24
BLACK_STDDEV = 8


def render_video(data: bytes, source_type: str, opts: RenderOptions) -> Thumbnail:
    """Decode one representative keyframe and encode it at every size."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", options={"probesize": "5000000"})
    except (av.error.FFmpegError, UnicodeDecodeError) as exc:
        # FFmpeg's errors, and metadata that is not the UTF-8 it must be.
        raise ThumbqError(CORRUPT_INPUT, f"video cannot be opened: {_reason(exc)}") from None
    try:
        frame = _pick_frame(container, data, source_type, opts)
    except (av.error.FFmpegError, UnicodeDecodeError) as exc:
        # What FFmpeg says beyond the steps that classify their own errors (a seek the damaged
        # index refuses: EPERM) is still this file's damage.
        raise ThumbqError(CORRUPT_INPUT, f"video is damaged: {_reason(exc)}") from None
    finally:
        container.close()
    return finish(frame, opts, source_type, degraded=opts.degraded)


def _pick_frame(
    container: object, data: bytes, source_type: str, opts: RenderOptions
) -> Image.Image:
    import av

    assert isinstance(container, av.container.InputContainer)
    if not container.streams.video:
        raise ThumbqError(UNSUPPORTED_TYPE, f"{source_type} has no video stream (audio only?)")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    if ctx is None:
        raise ThumbqError(CORRUPT_INPUT, f"{source_type}'s video stream names no known codec")
    width, height = ctx.width, ctx.height
    if width <= 0 or height <= 0:
        # FFmpeg zeroes a declared size it refuses (over about 268 million pixels) or lacks;
        # Matroska's header still says which it was.
        declared = matroska_frame_size(data) if source_type in (WEBM, MKV) else None
        if declared and declared[0] * declared[1] > opts.max_pixels:
            raise ThumbqError(
                TOO_LARGE,
                f"video declares {declared[0]}x{declared[1]} = "
                f"{declared[0] * declared[1]:,} pixels a frame, over the limit of "
                f"{opts.max_pixels:,}",
            )
        raise ThumbqError(CORRUPT_INPUT, f"{source_type} declares no usable frame size")
    if width * height > opts.max_pixels:
        raise ThumbqError(
            TOO_LARGE,
            f"video frames are {width}x{height} = {width * height:,} pixels, "
            f"over the limit of {opts.max_pixels:,}",
        )
    # Keyframes only: a keyframe decodes on its own, the frames between would each need the
    # whole chain before them. One thread: the render processes already use every core.
    ctx.skip_frame = "NONKEY"
    ctx.thread_count = 1
    if not opts.degraded and container.duration and container.duration > 0:
        try:
            # In AV_TIME_BASE (microseconds) without a stream; lands on the keyframe before.
            container.seek(int(container.duration * SEEK_FRACTION), backward=True)
        except av.error.FFmpegError:
            container.seek(0)
    best: tuple[float, Image.Image] | None = None
    for keyframes_only in (True, False):
        if not keyframes_only:
            # Every keyframe tried was black: decode the frames after the first one instead.
            ctx.skip_frame = "DEFAULT"
            try:
                container.seek(0)
            except av.error.FFmpegError:
                break
        tried = 0
        try:
            for frame in container.decode(stream):
                if frame.width * frame.height > opts.max_pixels:
                    raise ThumbqError(
                        TOO_LARGE,
                        f"video frames are {frame.width}x{frame.height}, over the pixel limit",
                    )
                img = _scaled(frame, ctx.sample_aspect_ratio, opts)
                if opts.degraded:
                    return img
                stat = ImageStat.Stat(img.convert("L"))
                mean, spread = stat.mean[0], stat.stddev[0]
                if mean > BLACK_MEAN or spread > BLACK_STDDEV:
                    return img
                if best is None or mean + spread > best[0]:
                    best = (mean + spread, img)
                tried += 1
                if tried >= (MAX_KEYFRAMES if keyframes_only else MAX_FRAMES):
                    break
        except av.error.FFmpegError as exc:
            if best is None:
                raise ThumbqError(
                    CORRUPT_INPUT, f"video cannot be decoded: {_reason(exc)}"
                ) from None
    if best is None:
        raise ThumbqError(CORRUPT_INPUT, "video has no frame that can be decoded")
    return best[1]


def _scaled(frame: object, sar: object, opts: RenderOptions) -> Image.Image:
    """The frame, scaled by FFmpeg into the largest box (non-square pixels made square by the
    sample aspect ratio `sar`), upright as its display matrix says."""
    from fractions import Fraction

    import av

    assert isinstance(frame, av.VideoFrame)
    width, height = frame.width, frame.height
    if isinstance(sar, Fraction) and sar.numerator > 0 and sar != 1:
        width = max(1, round(width * sar.numerator / sar.denominator))
    target = fit_inside((width, height), opts.size) or (width, height)
    img = frame.reformat(
        width=target[0],
        height=target[1],
        format="rgb24",
        interpolation="FAST_BILINEAR" if opts.degraded else "AREA",
    ).to_image()
    rotation = round(getattr(frame, "rotation", 0) or 0) % 360
    if rotation:
        # The display matrix turns the picture `rotation` degrees counter-clockwise.
        img = img.rotate(rotation, expand=True)
    return img


def _reason(exc: BaseException) -> str:
    return (str(exc).strip() or type(exc).__name__)[:200]


# Matroska elements on the way from the file to a video track's frame size.
_SEGMENT, _TRACKS, _TRACK_ENTRY, _VIDEO = 0x18538067, 0x1654AE6B, 0xAE, 0xE0
_PIXEL_WIDTH, _PIXEL_HEIGHT = 0xB0, 0xBA
# The track headers sit near the start; a walk reads no further than this.
_MATROSKA_HEADER_BYTES = 1024 * 1024


def matroska_frame_size(data: bytes) -> tuple[int, int] | None:
    """The first video track's PixelWidth x PixelHeight as a Matroska/WebM file declares them,
    or None (FFmpeg gives no size at all when it refuses one, so the error can name it)."""
    view = data[:_MATROSKA_HEADER_BYTES]
    found: dict[int, int] = {}

    def walk(start: int, end: int, depth: int) -> None:
        pos = start
        while pos < end and depth < 6 and len(found) < 2:
            element, pos = _vint(view, pos, keep_marker=True)
            size, pos = _vint(view, pos, keep_marker=False)
            if element < 0 or size < -1:
                return
            body_end = end if size == -1 else min(pos + size, end)
            if element in (_SEGMENT, _TRACKS, _TRACK_ENTRY, _VIDEO):
                walk(pos, body_end, depth + 1)
            elif element in (_PIXEL_WIDTH, _PIXEL_HEIGHT) and 0 < size <= 8:
                found.setdefault(element, int.from_bytes(view[pos:body_end], "big"))
            pos = body_end

    walk(0, len(view), 0)
    if _PIXEL_WIDTH in found and _PIXEL_HEIGHT in found:
        return found[_PIXEL_WIDTH], found[_PIXEL_HEIGHT]
    return None


def _vint(data: bytes, pos: int, *, keep_marker: bool) -> tuple[int, int]:
    """An EBML variable-length integer at `pos`: (value, position after it); (-2, end) when the
    data ends or is malformed; a size with every value bit set is -1 (unknown)."""
    if pos >= len(data) or data[pos] == 0:
        return -2, len(data)
    length = 8 - data[pos].bit_length() + 1
    if pos + length > len(data):
        return -2, len(data)
    raw = int.from_bytes(data[pos : pos + length], "big")
    if keep_marker:
        return raw, pos + length
    value = raw & ((1 << (7 * length)) - 1)
    if value == (1 << (7 * length)) - 1:
        return -1, pos + length
    return value, pos + length
