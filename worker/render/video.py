"""Video (MP4, MOV, WebM, MKV) to a thumbnail of one representative frame, with PyAV (FFmpeg).

Only keyframes are decoded: seek to about 10% of the duration, then take the first keyframe that
is not black (fade-ins and title cards are common). FFmpeg scales the frame straight to the
largest box, so no full-size RGB picture is ever made. The frame size is checked against the
pixel limit from the stream's header, before anything is decoded.
"""

from __future__ import annotations

import io

from PIL import Image, ImageStat

from worker.errors import CORRUPT_INPUT, TOO_LARGE, UNSUPPORTED_TYPE, ThumbqError
from worker.render import RenderOptions, Thumbnail
from worker.render.output import finish, fit_inside

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
    except av.error.FFmpegError as exc:
        raise ThumbqError(CORRUPT_INPUT, f"video cannot be opened: {_reason(exc)}") from None
    try:
        frame = _pick_frame(container, source_type, opts)
    finally:
        container.close()
    return finish(frame, opts, source_type, degraded=opts.degraded)


def _pick_frame(container: object, source_type: str, opts: RenderOptions) -> Image.Image:
    import av

    assert isinstance(container, av.container.InputContainer)
    if not container.streams.video:
        raise ThumbqError(UNSUPPORTED_TYPE, f"{source_type} has no video stream (audio only?)")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    width, height = ctx.width, ctx.height
    if width <= 0 or height <= 0:
        # FFmpeg zeroes a declared size it refuses (over about 268 million pixels) or lacks.
        raise ThumbqError(
            CORRUPT_INPUT,
            f"{source_type} declares no frame size FFmpeg accepts (zero, or far over "
            f"{opts.max_pixels:,} pixels)",
        )
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
