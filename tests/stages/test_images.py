"""L3 images (docs/layers.md) with Pillow: caps at first sight, resize ladder, omissions,
decompression bombs, EXIF orientation, deterministic bytes, too many images per request."""

from __future__ import annotations

import base64
import io
import random
import struct
import time
import zlib
from typing import Any

import polars as pl
import pytest
from PIL import Image

from ctxreplay.pipeline.stageapi.registry import StageContext
from ctxreplay.stages.images import MEMO, NO_IMAGE_INPUT, STALE, Images, fit_image, sniff_media_type
from ctxreplay.testkit import make_blocks, run_stage, view, visible


def png(w: int, h: int, color: tuple[int, ...] = (200, 30, 30), mode: str = "RGB") -> str:
    buf = io.BytesIO()
    Image.new(mode, (w, h), color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def jpeg(w: int, h: int, *, orientation: int | None = None) -> str:
    img = Image.new("RGB", (w, h), (10, 120, 200))
    buf = io.BytesIO()
    if orientation is None:
        img.save(buf, format="JPEG")
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.save(buf, format="JPEG", exif=exif)
    return base64.b64encode(buf.getvalue()).decode()


def noise_png(w: int, h: int, seed: int = 0) -> str:
    img = Image.frombytes("RGB", (w, h), random.Random(seed).randbytes(w * h * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


def png_header_only(w: int, h: int) -> str:
    """A PNG whose header claims w × h pixels, with almost no pixel data behind it."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    return base64.b64encode(raw).decode()


def img(data: str | None, media: str | None = "image/png") -> dict[str, Any]:
    return {"type": "image", "image_media_type": media, "image_data": data}


def _run(messages: list[dict[str, Any]], params: dict[str, Any] | None = None, ctx: StageContext | None = None):
    res = run_stage("images", make_blocks(messages), params or {}, ctx=ctx)
    return res.blocks.collect(), res.decisions.collect()


def _omitted(data: str | None, media: str | None = "image/png", **params: Any) -> str | None:
    return fit_image(data, media, Images(**params)).reason


# ---------------------------------------------------------------- §13 cases


def test_3000px_image_in_a_2_image_request_is_resized_at_first_sight() -> None:
    msgs = [{"role": "user", "blocks": [{"type": "text", "text": "two"}, img(png(3000, 1200)), img(png(50, 50))]},
            {"role": "assistant", "text": "ok"}]
    blocks, dec = _run(msgs)
    big = blocks.filter(pl.col("block_pos") == 1).row(0, named=True)
    assert (big["image_width"], big["image_height"], big["image_media_type"]) == (2000, 800, "image/jpeg")
    assert big["first_call"] == 0 and big["last_call"] is None  # one version: resized from first sight
    assert dec.select("block_pos", "from_call", "action", "reason").rows() == [(1, 0, "replace", "image_resize")]
    data = base64.b64decode(big["image_data"])
    assert Image.open(io.BytesIO(data)).size == (2000, 800)
    small = blocks.filter(pl.col("block_pos") == 2).row(0, named=True)
    assert (small["image_width"], small["image_height"]) == (50, 50)  # measured, unchanged, no decision


def test_a_6_mb_base64_image_is_brought_under_the_byte_cap() -> None:
    data = noise_png(1300, 1200)  # ~4.7 MB decoded, ~6.2 MB base64
    assert len(data) > 6_000_000
    res = fit_image(data, "image/png", Images())
    assert res.status == "resize" and res.data is not None
    assert len(res.data) <= 5_242_880
    assert (res.width, res.height) == (1300, 1200)  # no enlargement; the long edge is under the limit


def test_a_truncated_image_is_omitted_with_its_reason() -> None:
    data = base64.b64decode(png(300, 300))
    truncated = base64.b64encode(data[: len(data) // 2]).decode()
    msgs = [{"role": "user", "blocks": [img(truncated)]}]
    blocks, dec = _run(msgs)
    assert view(blocks)["text"].to_list() == ["[image omitted: corrupt image data]"]
    assert dec.select("action", "reason").rows() == [("replace", "image_omitted")]


# ---------------------------------------------------------------- omissions


@pytest.mark.parametrize(("data", "media", "reason"), [
    ("", "image/png", "empty payload"),
    ("!!not base64!!", "image/png", "invalid base64"),
    (None, "image/png", "missing data or media type"),
    ("iVBORw0KGgo=", None, "missing data or media type"),
    (base64.b64encode(b"BM" + b"\x00" * 60).decode(), "image/bmp", "unsupported media type image/bmp"),
])
def test_omission_reasons(data: str | None, media: str | None, reason: str) -> None:
    assert _omitted(data, media) == reason


def test_a_payload_over_the_input_limit_is_not_decoded() -> None:
    assert _omitted(png(10, 10), max_input_b64_bytes=50) == "exceeds input size limit (0 MB)"
    assert Images().max_input_b64_bytes == 14_000_000
    assert _omitted("A" * 15_000_000) == "exceeds input size limit (13.35 MB)"


def test_a_decompression_bomb_header_is_refused_without_decoding() -> None:
    t0 = time.perf_counter()
    assert _omitted(png_header_only(100_000, 100_000)) == "pixel count exceeds 25000000"
    assert _omitted(png_header_only(6000, 5000)) == "pixel count exceeds 25000000"
    assert time.perf_counter() - t0 < 1.0


def test_could_not_be_reduced() -> None:
    reason = _omitted(noise_png(900, 900), max_b64_bytes=50_000)
    assert reason is not None and reason.startswith("could not be reduced below 0.05 MB (got ")
    assert reason.endswith(" MB)")


def test_omitted_tool_result_image_stays_a_tool_result_part() -> None:
    msgs = [{"role": "tool", "blocks": [
        {"type": "tool_result", "tool_use_id": "t1", "part_type": "text", "text": "shot:"},
        {"type": "tool_result", "tool_use_id": "t1", "part_type": "image", "part_pos": 1,
         "image_media_type": "image/png", "image_data": "%%%"}]}]
    blocks, _ = _run(msgs)
    row = blocks.filter(pl.col("part_pos") == 1).row(0, named=True)
    assert (row["block_type"], row["part_type"], row["tool_use_id"], row["text"]) == (
        "tool_result", "text", "t1", "[image omitted: invalid base64]")
    assert row["image_data"] is None


def test_an_image_given_by_url_is_left_alone() -> None:
    msgs = [{"role": "user", "blocks": [{"type": "image", "extra": {"url": "https://example.com/a.png"}}]}]
    _, dec = _run(msgs)
    assert dec.height == 0


# ---------------------------------------------------------------- measuring


def test_sniffed_type_overrides_the_declared_one() -> None:
    assert sniff_media_type(base64.b64decode(jpeg(4, 4))) == "image/jpeg"
    blocks, dec = _run([{"role": "user", "blocks": [img(jpeg(40, 30), "image/png")]}])
    row = view(blocks).row(0, named=True)
    assert (row["image_media_type"], row["image_width"], row["image_height"]) == ("image/jpeg", 40, 30)
    assert dec["reason"].to_list() == ["image_media_type"]


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_gif_and_webp_are_supported(fmt: str) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (30, 20), (1, 2, 3)).save(buf, format=fmt)
    res = fit_image(base64.b64encode(buf.getvalue()).decode(), f"image/{fmt.lower()}", Images())
    assert (res.status, res.width, res.height) == ("keep", 30, 20)


def test_exif_orientation_applies_to_the_measured_size_and_to_resizing() -> None:
    res = fit_image(jpeg(200, 100, orientation=6), "image/jpeg", Images())
    assert (res.status, res.width, res.height) == ("keep", 100, 200)
    res = fit_image(jpeg(3000, 1000, orientation=6), "image/jpeg", Images())
    assert (res.status, res.width, res.height) == ("resize", 667, 2000)
    out = Image.open(io.BytesIO(base64.b64decode(res.data or "")))
    assert out.size == (667, 2000) and not out.getexif()


def test_alpha_is_flattened_on_white() -> None:
    res = fit_image(png(2400, 100, (0, 0, 0, 0), mode="RGBA"), "image/png", Images())
    out = Image.open(io.BytesIO(base64.b64decode(res.data or ""))).convert("RGB")
    assert out.getpixel((10, 10)) == (255, 255, 255)


def test_normalize_mode_caps_to_the_target_side() -> None:
    res = fit_image(png(1800, 900), "image/png", Images(mode="normalize"))
    assert (res.status, res.width, res.height) == ("resize", 1568, 784)
    assert fit_image(png(1800, 900), "image/png", Images()).status == "keep"


def test_reencoded_bytes_are_deterministic_and_memoised() -> None:
    data = noise_png(2100, 300, seed=3)
    MEMO.clear()
    a = MEMO.get(data, "image/png", Images())
    MEMO.clear()
    b = fit_image(data, "image/png", Images())
    assert a.data == b.data and a.data is not None
    c = MEMO.get(data, "image/png", Images())
    d = MEMO.get(data, "image/png", Images())
    assert (MEMO.misses, MEMO.hits) == (1, 1) and d is c and c.data == a.data


def test_params_are_validated() -> None:
    from ctxreplay.errors import SpecError
    from ctxreplay.pipeline.stageapi.registry import get_stage
    from ctxreplay.pipeline.staging.spec import resolve_params

    with pytest.raises(SpecError, match="max_side_px must be positive"):
        resolve_params(get_stage("images"), {"max_side_px": 0}, where="t")


# ---------------------------------------------------------------- per request


def _turns(n: int, per_turn: int = 1) -> list[dict[str, Any]]:
    small = png(8, 8)
    msgs: list[dict[str, Any]] = []
    for t in range(n):
        msgs.append({"role": "user", "blocks": [{"type": "text", "text": f"turn {t}"}] + [img(small)] * per_turn})
        msgs.append({"role": "assistant", "text": "ok"})
    return msgs


def test_too_many_images_replaces_those_outside_the_recent_turns_from_that_call() -> None:
    blocks, dec = _run(_turns(6), {"max_images_per_request": 3, "keep_recent_image_turns": 1})
    images_at = lambda call: visible(blocks, call).filter(pl.col("block_type") == "image")["entry_id"].to_list()
    assert images_at(2) == ["e0000", "e0002", "e0004"]          # 3 images: nothing to do
    assert images_at(3) == ["e0004", "e0006"]                   # 4 > 3: turns before the last completed one go
    assert visible(blocks, 3).filter(pl.col("entry_id") == "e0000")["text"].to_list()[1] == STALE
    assert images_at(2) == ["e0000", "e0002", "e0004"]          # earlier calls keep what they saw
    assert sorted(dec.select("entry_id", "from_call", "reason").rows()) == [
        ("e0000", 3, "image_stale"), ("e0002", 3, "image_stale"), ("e0004", 5, "image_stale"),
        ("e0006", 5, "image_stale")]
    again = run_stage("images", blocks.lazy(), {"max_images_per_request": 3, "keep_recent_image_turns": 1})
    assert again.decisions.collect().height == 0


def test_when_recent_turns_alone_hold_too_many_the_oldest_go() -> None:
    blocks, dec = _run(_turns(1, per_turn=5), {"max_images_per_request": 3})
    assert visible(blocks, 1).filter(pl.col("block_type") == "image")["block_pos"].to_list() == [3, 4, 5]
    assert sorted(dec["block_pos"].to_list()) == [1, 2]


def test_target_without_image_input() -> None:
    blocks, dec = _run(_turns(2), ctx=StageContext(supports_images=False))
    assert blocks.filter(pl.col("block_type") == "image").height == 0
    assert blocks.filter(pl.col("text") == NO_IMAGE_INPUT).height == 2
    assert set(dec["reason"]) == {"image_input_unsupported"}
