"""The credentials thumbq signs with its admin secret: the progress page's read-only token and the
gallery's thumbnail URLs. Each works until it expires, for its own purpose only, and stops
working when the secret changes."""

from __future__ import annotations

import pytest

from worker.app.signing import (
    PAGE_TOKEN_TTL_S,
    is_page_token,
    page_token,
    page_token_expired,
    thumbnail_signature,
    thumbnail_signature_ok,
)

SECRET = "signing-test-secret-0123456789abcdef"
NOW = 1_800_000_000.0


def test_a_page_token_works_until_it_expires_and_not_a_second_longer() -> None:
    token = page_token(SECRET, ttl_s=60, now=NOW)
    assert page_token_expired(token, SECRET, now=NOW) is False
    assert page_token_expired(token, SECRET, now=NOW + 59.9) is False
    assert page_token_expired(token, SECRET, now=NOW + 60) is True
    default = page_token(SECRET, now=NOW)
    assert page_token_expired(default, SECRET, now=NOW + PAGE_TOKEN_TTL_S - 1) is False
    assert page_token_expired(default, SECRET, now=NOW + PAGE_TOKEN_TTL_S) is True


def test_a_page_token_never_looks_like_a_jwt() -> None:
    token = page_token(SECRET, now=NOW)
    assert is_page_token(token) and token.count(".") == 3
    assert not is_page_token("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJl")


@pytest.mark.parametrize(
    "forge",
    [
        lambda t: page_token("another-secret-0123456789abcdef", ttl_s=60, now=NOW),
        lambda t: t.replace(t.split(".")[2], str(int(t.split(".")[2]) + 86_400)),
        lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),
        lambda t: t.rpartition(".")[0] + ".",
        lambda t: t.rpartition(".")[0] + ".é",
        lambda t: "tqp.1.99999999999999." + t.rpartition(".")[2],
        lambda t: "tqp.1.-5." + t.rpartition(".")[2],
        lambda t: "not a token at all",
    ],
    ids=[
        "other-secret",
        "longer-expiry",
        "edited-signature",
        "no-signature",
        "non-ascii",
        "absurd-expiry",
        "negative-expiry",
        "garbage",
    ],
)
def test_a_forged_or_edited_page_token_is_no_token(forge: object) -> None:
    token = page_token(SECRET, ttl_s=60, now=NOW)
    assert callable(forge)
    assert page_token_expired(forge(token), SECRET, now=NOW) is None


def test_changing_the_secret_revokes_every_page_token() -> None:
    token = page_token(SECRET, ttl_s=3600, now=NOW)
    assert page_token_expired(token, SECRET + "-rotated", now=NOW) is None


def test_a_thumbnail_url_opens_one_key_until_it_expires() -> None:
    key = "thumbnails/photos/cat.jpg/etag-512.webp"
    expires = int(NOW) + 3600
    sig = thumbnail_signature(SECRET, key, expires)
    assert thumbnail_signature_ok(SECRET, key, expires, sig, now=NOW)
    assert not thumbnail_signature_ok(SECRET, key, expires, sig, now=expires)
    assert not thumbnail_signature_ok(SECRET, key + "x", expires, sig, now=NOW)
    assert not thumbnail_signature_ok(SECRET, "thumbnails/photos/dog.jpg", expires, sig, now=NOW)
    assert not thumbnail_signature_ok(SECRET, key, expires + 1, sig, now=NOW)
    assert not thumbnail_signature_ok("another-secret-0123456789", key, expires, sig, now=NOW)
    assert not thumbnail_signature_ok(SECRET, key, expires, "ünicode", now=NOW)


def test_a_signature_made_for_one_purpose_is_worthless_for_the_other() -> None:
    token = page_token(SECRET, ttl_s=60, now=NOW)
    expires = int(token.split(".")[2])
    page_signature = token.rpartition(".")[2]
    # The page token signs "tqp.1.<expires>"; the same message as a thumbnail key gets nothing.
    assert not thumbnail_signature_ok(SECRET, "tqp.1", expires, page_signature, now=NOW)
    sig = thumbnail_signature(SECRET, "k", expires)
    assert page_token_expired(f"tqp.1.{expires}.{sig}", SECRET, now=NOW) is None


def test_the_key_and_the_expiry_cannot_be_traded_against_each_other() -> None:
    # A separator between expiry and key: moving digits from one to the other changes the message.
    sig = thumbnail_signature(SECRET, "1/a.webp", 1_900_000_000)
    assert not thumbnail_signature_ok(SECRET, "/a.webp", 19_000_000_001, sig, now=NOW)
