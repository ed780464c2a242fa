"""Sample files for `thumbq demo`: slides, a report, photos, and two deliberately bad files."""

from __future__ import annotations

import io
import random


def photo(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG: smooth colour gradients with grain, so it compresses like a photo.

    Public: bench/batch.py puts one in its mix."""
    from PIL import Image, ImageDraw, ImageFilter

    rnd = random.Random(seed)
    small = (max(width // 4, 1), max(height // 4, 1))
    grad = Image.linear_gradient("L")
    r = grad.resize(small)
    g = grad.rotate(90).resize(small)
    b = Image.effect_noise(small, 40).filter(ImageFilter.GaussianBlur(1))
    img = Image.merge("RGB", (r, g, b)).resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = rnd.randrange(width), rnd.randrange(height)
        rad = rnd.randrange(min(width, height) // 20, min(width, height) // 5)
        colour = (rnd.randrange(256), rnd.randrange(256), rnd.randrange(256))
        draw.ellipse((x - rad, y - rad, x + rad, y + rad), fill=colour)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=85)
    return out.getvalue()


def _slides(title: str, pages: int, seed: int) -> bytes:
    """A slide deck: a title, bullet points, vector shapes and an embedded photo per page."""
    import pymupdf

    doc = pymupdf.open()
    picture = photo(1200, 800, seed)
    for n in range(pages):
        page = doc.new_page(width=960, height=540)
        page.draw_rect(page.rect, color=None, fill=(0.95, 0.96, 1.0))
        page.draw_rect(pymupdf.Rect(0, 0, 960, 70), color=None, fill=(0.12, 0.2, 0.45))
        page.insert_text((40, 48), f"{title} ({n + 1}/{pages})", fontsize=30, color=(1, 1, 1))
        for i, line in enumerate(
            ("Queues in Postgres", "Budgets, not timeouts", "Progress you can watch")
        ):
            page.insert_text((50, 130 + 45 * i), f"- {line}", fontsize=22)
        page.draw_circle((200, 420), 60, color=(0.8, 0.3, 0.1), fill=(1, 0.7, 0.3))
        page.insert_image(pymupdf.Rect(520, 110, 920, 377), stream=picture)
    data = doc.tobytes(garbage=3, deflate=True)
    doc.close()
    return bytes(data)


def _png_with_alpha() -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGBA", (900, 600), (0, 0, 0, 0))
    draw = ImageDraw.Draw(img)
    draw.rounded_rectangle((50, 50, 850, 550), radius=80, fill=(30, 120, 200, 200))
    draw.ellipse((300, 150, 600, 450), fill=(250, 200, 40, 255))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def _animated_gif() -> bytes:
    from PIL import Image, ImageDraw

    frames = []
    for i in range(6):
        frame = Image.new("RGB", (320, 240), (20 * i, 40, 120))
        ImageDraw.Draw(frame).rectangle((20 + 40 * i, 80, 80 + 40 * i, 160), fill=(255, 255, 0))
        frames.append(frame)
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return out.getvalue()


def demo_files() -> dict[str, tuple[bytes, str]]:
    """{name: (bytes, content type)} for the demo; two are bad on purpose."""
    harbour = photo(4000, 3000, 1)
    return {
        "slides/quarterly-review.pdf": (_slides("Quarterly review", 12, 2), "application/pdf"),
        "slides/architecture.pdf": (_slides("Architecture", 8, 3), "application/pdf"),
        "slides/onboarding.pdf": (_slides("Onboarding", 5, 4), "application/pdf"),
        "reports/annual-report.pdf": (_slides("Annual report", 40, 5), "application/pdf"),
        "photos/harbour-4000x3000.jpg": (harbour, "image/jpeg"),
        "photos/street-2400x1600.jpg": (photo(2400, 1600, 6), "image/jpeg"),
        "photos/portrait-1200x1800.jpg": (photo(1200, 1800, 7), "image/jpeg"),
        "graphics/logo-with-alpha.png": (_png_with_alpha(), "image/png"),
        "graphics/spinner.gif": (_animated_gif(), "image/gif"),
        # Bad on purpose: a photo cut in half, and an archive, which has no picture to show.
        "broken/cut-off-photo.jpg": (harbour[: len(harbour) // 3], "image/jpeg"),
        "broken/notes.zip": (_zip_of_text(), "application/zip"),
    }


def _zip_of_text() -> bytes:
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("notes.txt", "Agenda\n- slides\n- photos\n")
    return out.getvalue()
