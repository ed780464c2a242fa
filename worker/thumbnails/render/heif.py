"""HEIC pictures decoded with FFmpeg's HEVC decoder (the one PyAV bundles), shrunk tile by tile.

libheif (through pillow-heif) decodes HEVC with libde265: 565 ms for a 12 MP picture on this
project's machine, where FFmpeg's decoder takes 417 ms on one thread and about 225 ms on two.
HEVC has no reduced-scale decode, so the decoder is what there is to gain. This module reads the
HEIF container itself (ISO/IEC 23008-12: `meta` with `pitm`, `iinf`, `iloc`, `iref`, `iprp`,
`idat`), hands each coded picture to one FFmpeg decoder, and shrinks every decoded tile into
its place in a small canvas as it comes out, so the full-size picture never exists in RGB.

It takes the shape phones and encoders write: a primary item that is one `hvc1` picture or a
`grid` of them, 8 bits a channel, with `ispe`, `irot`, `imir`, `colr` and `pixi` properties, and
auxiliary images other than alpha (depth maps, HDR gain maps) ignored, as pillow-heif is asked
to. Anything else (alpha, a crop, more bits, an unknown essential property, overlays, another
codec, anything malformed) returns None and libheif decodes the file as before.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

# A grid this large is not a photo; libheif has its own limits for those.
MAX_TILES = 4096
# The alpha auxiliary types (HEVC's and MIAF's): a picture with one goes to libheif.
_ALPHA_AUX = (b"urn:mpeg:hevc:2015:auxid:1", b"urn:mpeg:mpegB:cicp:systems:auxiliary:alpha")
# The properties this reader understands; an essential one outside it means "not ours".
_KNOWN_PROPERTIES = frozenset({b"hvcC", b"ispe", b"irot", b"imir", b"colr", b"pixi", b"auxC"})
# nclx matrix_coefficients -> FFmpeg's colourspace names; others go to libheif.
_MATRICES = {1: "ITU709", 5: "ITU601", 6: "ITU601", 2: None}


class NotForUs(Exception):
    """The file is outside the shape this reader takes: libheif decodes it instead."""


@dataclass
class _Item:
    type: bytes = b""
    extents: list[tuple[int, int, int]] = field(default_factory=list)  # (method, offset, len)
    properties: list[tuple[bytes, int, int, bool]] = field(default_factory=list)


@dataclass
class Picture:
    """What the container says about the primary picture, before anything is decoded."""

    width: int
    height: int
    hvcc: bytes
    tiles: list[bytes]
    columns: int
    rows: int
    transforms: list[tuple[bytes, int]]
    icc_profile: bytes | None
    matrix: str | None
    full_range: bool | None


def _boxes(buf: memoryview, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """The boxes between `start` and `end`: (type, first byte of the payload, end)."""
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", buf, pos)
        header = 8
        if size == 1:
            if pos + 16 > end:
                raise NotForUs("truncated box")
            (size,) = struct.unpack_from(">Q", buf, pos + 8)
            header = 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            raise NotForUs("a box runs past its parent")
        yield kind, pos + header, pos + size
        pos += size


def _uint(buf: memoryview, pos: int, size: int) -> int:
    if size == 0:
        return 0
    return int.from_bytes(buf[pos : pos + size], "big")


def parse(data: bytes) -> Picture:
    """The primary picture of a HEIF file, or `NotForUs`."""
    try:
        return _parse(memoryview(data))
    except (struct.error, IndexError, ValueError, StopIteration) as exc:
        raise NotForUs(f"malformed container: {exc}") from None


def _parse(buf: memoryview) -> Picture:
    meta = next((b for b in _boxes(buf, 0, len(buf)) if b[0] == b"meta"), None)
    if meta is None:
        raise NotForUs("no meta box")
    items: dict[int, _Item] = {}
    primary = None
    idat = (0, 0)
    refs: list[tuple[bytes, int, list[int]]] = []
    ipco: list[tuple[bytes, int, int]] = []
    ipma: list[tuple[int, list[tuple[int, bool]]]] = []
    for kind, start, end in _boxes(buf, meta[1] + 4, meta[2]):
        version = buf[start] if end > start else 0
        body = start + 4
        if kind == b"pitm":
            primary = _uint(buf, body, 2 if version == 0 else 4)
        elif kind == b"iinf":
            first = body + (2 if version == 0 else 4)
            for sub, s, _e in _boxes(buf, first, end):
                if sub != b"infe" or buf[s] < 2:
                    continue
                id_size = 2 if buf[s] == 2 else 4
                item_id = _uint(buf, s + 4, id_size)
                kind_at = s + 4 + id_size + 2
                items.setdefault(item_id, _Item()).type = bytes(buf[kind_at : kind_at + 4])
        elif kind == b"iloc":
            _parse_iloc(buf, body, version, items)
        elif kind == b"iref":
            id_size = 2 if version == 0 else 4
            for sub, s, _e in _boxes(buf, body, end):
                source = _uint(buf, s, id_size)
                count = _uint(buf, s + id_size, 2)
                to = [_uint(buf, s + id_size + 2 + i * id_size, id_size) for i in range(count)]
                refs.append((sub, source, to))
        elif kind == b"iprp":
            for sub, s, e in _boxes(buf, start, end):
                if sub == b"ipco":
                    ipco = list(_boxes(buf, s, e))
                elif sub == b"ipma":
                    ipma = _parse_ipma(buf, s, e)
        elif kind == b"idat":
            idat = (start, end)
    for item_id, associations in ipma:
        item = items.setdefault(item_id, _Item())
        for index, essential in associations:
            if not 1 <= index <= len(ipco):
                raise NotForUs("a property index is out of range")
            prop, s, e = ipco[index - 1]
            item.properties.append((prop, s, e, essential))
    if primary is None or primary not in items:
        raise NotForUs("no primary item")
    for kind, source, to in refs:
        if kind == b"auxl" and primary in to:
            aux = items.get(source)
            aux_c = _property(buf, aux, b"auxC") if aux else None
            if (
                aux_c is None
                or bytes(buf[aux_c[0] + 4 : aux_c[1]]).rstrip(b"\0").split(b"\0")[0] in _ALPHA_AUX
            ):
                raise NotForUs("the picture has an alpha plane")
    item = items[primary]
    _check_properties(item)
    if item.type == b"hvc1":
        tile_ids, columns, rows = [primary], 1, 1
        width, height = _ispe(buf, item)
    elif item.type == b"grid":
        tile_ids = next((to for kind, src, to in refs if kind == b"dimg" and src == primary), [])
        grid = _item_data(buf, item, idat)
        if len(grid) < 8 or grid[0] != 0:
            raise NotForUs("unknown grid version")
        rows, columns = grid[2] + 1, grid[3] + 1
        wide = grid[1] & 1
        if len(grid) < (12 if wide else 8):
            raise NotForUs("truncated grid")
        width = _uint(memoryview(grid), 4, 4 if wide else 2)
        height = _uint(memoryview(grid), 8 if wide else 6, 4 if wide else 2)
        if len(tile_ids) != rows * columns or len(tile_ids) > MAX_TILES:
            raise NotForUs("the grid and its tiles disagree")
    else:
        raise NotForUs(f"primary item is {item.type!r}")
    hvcc = None
    tiles = []
    for tile_id in tile_ids:
        tile = items.get(tile_id)
        if tile is None or tile.type != b"hvc1":
            raise NotForUs("a tile is not an HEVC picture")
        if tile is not item:
            _check_properties(tile)
            if any(p[0] in (b"irot", b"imir") for p in tile.properties):
                raise NotForUs("a tile is transformed")
        conf = _property(buf, tile, b"hvcC")
        if conf is None:
            raise NotForUs("a tile has no decoder configuration")
        record = bytes(buf[conf[0] : conf[1]])
        if hvcc is None:
            hvcc = record
        elif record != hvcc:
            raise NotForUs("tiles differ in their decoder configuration")
        tiles.append(_item_data(buf, tile, idat))
    assert hvcc is not None
    if width <= 0 or height <= 0:
        raise NotForUs("empty picture")
    icc, matrix, full_range = _colour(buf, item, items[tile_ids[0]])
    # irot and imir are plain boxes of one byte, applied in the order they are associated.
    transforms = [
        (prop, buf[s] & (3 if prop == b"irot" else 1))
        for prop, s, e, _ess in item.properties
        if prop in (b"irot", b"imir") and e > s
    ]
    return Picture(width, height, hvcc, tiles, columns, rows, transforms, icc, matrix, full_range)


def _parse_iloc(buf: memoryview, pos: int, version: int, items: dict[int, _Item]) -> None:
    if version > 2:
        raise NotForUs("unknown iloc version")
    offset_size, length_size = buf[pos] >> 4, buf[pos] & 15
    base_size, index_size = buf[pos + 1] >> 4, buf[pos + 1] & 15 if version else 0
    pos += 2
    count_size = 2 if version < 2 else 4
    count = _uint(buf, pos, count_size)
    pos += count_size
    for _ in range(count):
        item_id = _uint(buf, pos, count_size)
        pos += count_size
        method = 0
        if version:
            method = buf[pos + 1] & 15
            pos += 2
        data_ref = _uint(buf, pos, 2)
        base = _uint(buf, pos + 2, base_size)
        pos += 2 + base_size
        extents = _uint(buf, pos, 2)
        pos += 2
        out = []
        for _ in range(extents):
            pos += index_size
            offset = _uint(buf, pos, offset_size)
            length = _uint(buf, pos + offset_size, length_size)
            pos += offset_size + length_size
            out.append((method, base + offset, length))
        if data_ref != 0 or method > 1:
            out = [(-1, 0, 0)]
        items.setdefault(item_id, _Item()).extents = out
        if pos > len(buf):
            raise NotForUs("truncated iloc")


def _parse_ipma(buf: memoryview, start: int, end: int) -> list[tuple[int, list[tuple[int, bool]]]]:
    version, flags = buf[start], _uint(buf, start + 1, 3)
    pos = start + 4
    count = _uint(buf, pos, 4)
    pos += 4
    out = []
    for _ in range(count):
        id_size = 2 if version < 1 else 4
        item_id = _uint(buf, pos, id_size)
        pos += id_size
        n = buf[pos]
        pos += 1
        associations = []
        for _ in range(n):
            if flags & 1:
                value = _uint(buf, pos, 2)
                associations.append((value & 0x7FFF, bool(value >> 15)))
                pos += 2
            else:
                value = buf[pos]
                associations.append((value & 0x7F, bool(value >> 7)))
                pos += 1
        if pos > end:
            raise NotForUs("truncated ipma")
        out.append((item_id, associations))
    return out


def _check_properties(item: _Item) -> None:
    for prop, _s, _e, essential in item.properties:
        if essential and prop not in _KNOWN_PROPERTIES:
            raise NotForUs(f"essential property {prop!r}")
        if prop == b"clap":
            raise NotForUs("the picture is cropped (clap)")


def _property(buf: memoryview, item: _Item | None, kind: bytes) -> tuple[int, int] | None:
    if item is None:
        return None
    for prop, s, e, _ess in item.properties:
        if prop == kind:
            return s, e
    return None


def _ispe(buf: memoryview, item: _Item) -> tuple[int, int]:
    found = _property(buf, item, b"ispe")
    if found is None or found[1] - found[0] < 12:
        raise NotForUs("no image size (ispe)")
    return _uint(buf, found[0] + 4, 4), _uint(buf, found[0] + 8, 4)


def _item_data(buf: memoryview, item: _Item, idat: tuple[int, int]) -> bytes:
    parts = []
    for method, offset, length in item.extents:
        if method == 0:
            start, limit = offset, len(buf)
        elif method == 1:
            start, limit = idat[0] + offset, idat[1]
        else:
            raise NotForUs("item data elsewhere")
        if length == 0:
            length = limit - start
        if start < 0 or start + length > limit:
            raise NotForUs("item data runs past the file")
        parts.append(bytes(buf[start : start + length]))
    if not parts:
        raise NotForUs("item without data")
    return b"".join(parts)


def _colour(
    buf: memoryview, item: _Item, tile: _Item
) -> tuple[bytes | None, str | None, bool | None]:
    icc = None
    matrix = None
    full_range = None
    for source in (tile, item):
        for prop, s, e, _ess in source.properties:
            if prop == b"pixi":
                channels = buf[s + 4]
                if any(buf[s + 5 + i] != 8 for i in range(channels)):
                    raise NotForUs("more than 8 bits a channel")
            if prop != b"colr" or e - s < 4:
                continue
            kind = bytes(buf[s : s + 4])
            if kind in (b"prof", b"rICC"):
                icc = bytes(buf[s + 4 : e])
            elif kind == b"nclx" and e - s >= 11:
                code = _uint(buf, s + 8, 2)
                if code not in _MATRICES:
                    raise NotForUs(f"colour matrix {code}")
                matrix = _MATRICES[code]
                full_range = bool(buf[s + 10] >> 7)
    return icc, matrix, full_range


def upright_size(pic: Picture) -> tuple[int, int]:
    """The picture's size once its rotation is applied."""
    quarter = sum(value for prop, value in pic.transforms if prop == b"irot") % 2
    return (pic.height, pic.width) if quarter else (pic.width, pic.height)


def decode(pic: Picture, target: tuple[int, int] | None, threads: int) -> tuple[Image.Image, int]:
    """Decode `pic` shrunk by the largest power of two that keeps it at least `target` (the
    upright fitted size; None: full size), upright, as RGB. Every tile goes from YUV to shrunk
    RGB in one pass of FFmpeg's scaler (an area average) and into its place in the canvas.
    Returns the picture and the factor it was shrunk by."""
    import av
    from av.video.reformatter import Colorspace, Interpolation, VideoReformatter

    # Shrinking: an area average with exact rounding and full chroma resolution, what Pillow's
    # reduce() gives from libheif's full RGB picture (48.8 dB apart on a 12 MP photo; without
    # the two flags 38.6). At full size the plain conversion is libheif's (49 dB; with full
    # chroma interpolation 36).
    exact = Interpolation.AREA | Interpolation.ACCURATE_RND | Interpolation.FULL_CHR_H_INT
    width, height = pic.width, pic.height
    factor = 1
    if target is not None:
        want_w, want_h = target if upright_size(pic) == (width, height) else (target[1], target[0])
        while width // (factor * 2) >= want_w and height // (factor * 2) >= want_h:
            factor *= 2
    ctx = av.CodecContext.create("hevc", "r")
    ctx.extradata = pic.hvcc
    # Tiles are independent pictures: frame threads decode them side by side; one picture
    # splits into slices or wavefront rows.
    ctx.thread_type = "FRAME" if len(pic.tiles) > 1 else "SLICE"
    ctx.thread_count = max(1, threads)
    # A coded picture larger than the container declares is refused by the decoder before it
    # allocates (then libheif has its say).
    ctx.options = {"max_pixels": str(2 * width * height + (1 << 20))}
    # One scaler for every tile, on this thread: a new one per tile, each starting its own
    # threads, cost 34 ms over 48 tiles against 10.
    reformatter = VideoReformatter()
    canvas: Image.Image | None = None
    tile_size: tuple[int, int] | None = None
    done = 0

    def place(frame: Any) -> None:
        nonlocal canvas, tile_size, factor, done
        if tile_size is None:
            tile_size = (frame.width, frame.height)
            if pic.columns * pic.rows > 1:
                # Tiles shrink to whole pixels so that they meet without seams.
                while factor > 1 and (frame.width % factor or frame.height % factor):
                    factor //= 2
                if frame.width * pic.columns < width or frame.height * pic.rows < height:
                    raise NotForUs("the tiles do not cover the grid")
            elif (frame.width, frame.height) != (width, height):
                raise NotForUs("the coded picture and its ispe disagree")
            canvas = Image.new(
                "RGB",
                (-(-frame.width // factor) * pic.columns, -(-frame.height // factor) * pic.rows),
            )
        elif (frame.width, frame.height) != tile_size:
            raise NotForUs("tiles of different sizes")
        if done >= len(pic.tiles):
            raise NotForUs("more pictures than tiles")
        shrunk = reformatter.reformat(
            frame,
            width=-(-frame.width // factor),
            height=-(-frame.height // factor),
            format="rgb24",
            src_colorspace=None if pic.matrix is None else Colorspace[pic.matrix],
            interpolation=exact if factor > 1 else Interpolation.AREA,
            src_color_range=(
                frame.color_range
                if pic.full_range is None
                else ("JPEG" if pic.full_range else "MPEG")
            ),
            dst_color_range="JPEG",
            threads=1,
        ).to_image()
        assert canvas is not None
        row, column = divmod(done, pic.columns)
        canvas.paste(shrunk, (column * shrunk.width, row * shrunk.height))
        done += 1

    try:
        for tile in pic.tiles:
            for frame in ctx.decode(av.Packet(tile)):
                place(frame)
        for frame in ctx.decode(None):
            place(frame)
    except (av.FFmpegError, MemoryError, ValueError) as exc:
        raise NotForUs(f"FFmpeg could not decode it: {exc}") from None
    if canvas is None or done != len(pic.tiles):
        raise NotForUs("fewer pictures than tiles")
    img = canvas.crop((0, 0, -(-width // factor), -(-height // factor)))
    for prop, value in pic.transforms:
        if prop == b"irot" and value:
            img = img.transpose(
                (
                    Image.Transpose.ROTATE_90,
                    Image.Transpose.ROTATE_180,
                    Image.Transpose.ROTATE_270,
                )[value - 1]
            )
        elif prop == b"imir":
            # HEIF's current text and libheif: 0 exchanges top and bottom, 1 left and right.
            img = img.transpose(
                Image.Transpose.FLIP_LEFT_RIGHT if value else Image.Transpose.FLIP_TOP_BOTTOM
            )
    if pic.icc_profile:
        img.info["icc_profile"] = pic.icc_profile
    return img, factor
