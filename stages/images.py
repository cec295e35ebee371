"""L3 images: measure, cap and, when needed, re-encode images; omit what cannot be sent (§5).

Each image block (a user or assistant `image` block, or an image part of a tool result) is decided
at first sight, from its own bytes and the parameters only, so the decision never changes when the
request later grows (a 3000 px image in a 2-image request is resized at once to `max_side_px`):

1. no data, no media type, empty or invalid base64, or a payload over `max_input_b64_bytes` →
   omitted (nothing above that size is decoded);
2. the real type is sniffed from the magic bytes (jpeg, png, gif, webp) and overrides the
   declared one; anything else is omitted;
3. the size is read from the header, EXIF orientation applied; a header claiming more than
   `max_pixels` is refused before any pixel is decoded (decompression bombs); the pixels are then
   decoded once so that a truncated or corrupt file is omitted rather than sent;
4. within the limits the block is unchanged (its measured size is filled in); otherwise it is
   resized with Pillow: sides [min(limit, long edge), 1800, …, 800] × JPEG qualities
   [85, …, 35], Lanczos, metadata stripped, alpha flattened on white, first fit wins.

Then, per call: when a request holds more than `max_images_per_request` images, images outside the
last `keep_recent_image_turns` completed turns (and, if still too many, the oldest) become
`[image data removed - already processed by model]` from that call on. For a target without image
input every image becomes a text note.

Results are memoised by sha256(input) + params + encoder version, so an image is re-encoded at
most once per process; the re-encoded bytes are deterministic.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import functools
import io
import math
import os
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import PIL
import polars as pl

from ctxreplay.pipeline.core.blockops import sha256_hex
from ctxreplay.pipeline.core.constants import IMAGE_OMITTED_TEXT as OMITTED
from ctxreplay.pipeline.core.constants import IMAGE_STALE_TEXT as STALE
from ctxreplay.pipeline.core.constants import NO_IMAGE_INPUT_TEXT as NO_IMAGE_INPUT
from ctxreplay.pipeline.core.constants import polars_format
from ctxreplay.pipeline.stageapi.live import Live, LiveRows, LiveRule, LiveThread
from ctxreplay.pipeline.stageapi.marks import (
    MSG_NO,
    THREAD_NO,
    alive,
    cover_end,
    finish,
    mark_replace,
    mark_replace_from,
    start_marks,
)
from ctxreplay.pipeline.stageapi.registry import Quiet, StageContext, StageResult, stage

if TYPE_CHECKING:
    from PIL import Image  # PIL.Image is imported where an image is decoded (~10 ms a run that decodes none)

SIDES = (1800, 1600, 1400, 1200, 1000, 800)
QUALITIES = (85, 75, 65, 55, 45, 35)
SUPPORTED = ("image/jpeg", "image/png", "image/gif", "image/webp")
MIB = 1024 * 1024
# Part of the result key and of what the layer's output depends on: another Pillow may encode
# other bytes (declared on the registration: the spec's config digest includes it).
ENCODER_VERSION = f"Pillow {PIL.__version__}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Images:
    mode: Literal["enforce", "normalize"] = "enforce"
    """enforce: act only when a limit is exceeded; normalize: always cap to target_max_side_px."""
    max_side_px: int = 2000
    """Longest side allowed (enforce), whatever the number of images in the request."""
    target_max_side_px: int = 1568
    """Longest side after resizing in normalize mode."""
    max_b64_bytes: int = 5_242_880
    """Largest base64 payload sent (bytes of base64 text)."""
    max_input_b64_bytes: int = 14_000_000
    """Payloads larger than this (base64 text) are omitted without being decoded."""
    max_pixels: int = 25_000_000
    """Width × height above which an image is omitted without decoding its pixels."""
    max_images_per_request: int = 100
    """More images than this in one request: older images are replaced by a short text."""
    keep_recent_image_turns: int = 3
    """Completed turns whose images are kept when a request has too many images."""

    def validate(self) -> None:
        for name in ("max_side_px", "target_max_side_px", "max_b64_bytes", "max_input_b64_bytes", "max_pixels",
                     "max_images_per_request"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")
        if self.keep_recent_image_turns < 0:
            raise ValueError(f"keep_recent_image_turns must be 0 or more; got {self.keep_recent_image_turns}")


# ----------------------------------------------------------------------------- one image


@dataclass(frozen=True, slots=True)
class ImageResult:
    """What becomes of one image payload."""

    status: Literal["keep", "fix_type", "resize", "omit"]
    data: str | None = None  # new base64 (resize)
    media_type: str | None = None  # sniffed / new media type
    width: int | None = None  # after EXIF orientation
    height: int | None = None
    nbytes: int | None = None  # decoded size of what is sent
    reason: str | None = None  # omit: the reason inside `[image omitted: …]`


def _mb(n: float) -> str:
    return f"{n / MIB:.2f}".rstrip("0").rstrip(".")


def sniff_media_type(raw: bytes) -> str | None:
    """The media type told by the magic bytes (jpeg, png, gif, webp), or None."""
    if raw[:3] == b"\xff\xd8\xff":
        return "image/jpeg"
    if raw[:8] == b"\x89PNG\r\n\x1a\n":
        return "image/png"
    if raw[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return None


def _b64len(n: int) -> int:
    return 4 * math.ceil(n / 3)


def _flatten(img: Image.Image) -> Image.Image:
    """RGB image: EXIF orientation applied, alpha flattened on white, metadata left behind."""
    from PIL import Image, ImageOps
    img = ImageOps.exif_transpose(img)
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGB", rgba.size, (255, 255, 255))
        bg.paste(rgba, mask=rgba.getchannel("A"))
        return bg
    if img.mode != "RGB":
        return img.convert("RGB")
    return img


def _encode_jpeg(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality, optimize=False, progressive=False)
    return buf.getvalue()


def fit_image(data: str | None, declared: str | None, p: Images) -> ImageResult:
    """Decide one image payload (pure: same input and params → same result and bytes)."""
    from PIL import Image
    raw = _payload(data, declared, p)
    if isinstance(raw, ImageResult):
        return raw
    sniffed = sniff_media_type(raw)
    if sniffed is None:
        return ImageResult("omit", reason=f"unsupported media type {(declared or '').strip().lower()}")
    opened = _open(raw, sniffed, p)
    if isinstance(opened, ImageResult):
        return opened
    img, w, h = opened
    limit = p.max_side_px if p.mode == "enforce" else min(p.target_max_side_px, p.max_side_px)
    long_edge = max(w, h)
    needs_resize = long_edge > limit or len(data or "") > p.max_b64_bytes
    if needs_resize and sniffed == "image/jpeg":
        # let libjpeg decode at 1/2, 1/4 or 1/8 scale, never below the first candidate size
        scale = min(limit, long_edge) / long_edge
        img.draft("RGB", (math.ceil(img.width * scale), math.ceil(img.height * scale)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()  # decode once: a truncated or corrupt file is omitted, never sent
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return ImageResult("omit", media_type=sniffed, width=w, height=h, reason="corrupt image data")
    if not needs_resize:
        status: Literal["keep", "fix_type"] = "keep" if sniffed == (declared or "").strip().lower() else "fix_type"
        return ImageResult(status, media_type=sniffed, width=w, height=h, nbytes=len(raw))
    return _resize(img, w, h, limit, sniffed, p)


def _payload(data: str | None, declared: str | None, p: Images) -> bytes | ImageResult:
    """The decoded bytes, or why the image is omitted before any decoding of pixels."""
    if data is None or declared is None or not declared.strip():
        if data == "":
            return ImageResult("omit", reason="empty payload")
        return ImageResult("omit", reason="missing data or media type")
    if data.strip() == "":
        return ImageResult("omit", reason="empty payload")
    if len(data) > p.max_input_b64_bytes:
        return ImageResult("omit", reason=f"exceeds input size limit ({_mb(p.max_input_b64_bytes)} MB)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return ImageResult("omit", reason="invalid base64")
    return raw if raw else ImageResult("omit", reason="empty payload")


def _open(raw: bytes, sniffed: str, p: Images) -> tuple[Image.Image, int, int] | ImageResult:
    """The image (header read only) and its size with EXIF orientation applied; a header claiming
    more than `max_pixels` is refused before any pixel is decoded (decompression bombs)."""
    from PIL import Image
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))  # reads the header only
            w, h = img.size
    except Image.DecompressionBombError:
        return ImageResult("omit", media_type=sniffed, reason=f"pixel count exceeds {p.max_pixels}")
    except (OSError, SyntaxError, ValueError):
        return ImageResult("omit", media_type=sniffed, reason="corrupt image data")
    if w * h > p.max_pixels:
        return ImageResult("omit", media_type=sniffed, reason=f"pixel count exceeds {p.max_pixels}")
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001  (a broken EXIF block is not a reason to refuse the image)
        orientation = 1
    if orientation in (5, 6, 7, 8):
        w, h = h, w
    return img, w, h


def _resize(img: Image.Image, w: int, h: int, limit: int, sniffed: str, p: Images) -> ImageResult:
    """Sides [min(limit, long edge), 1800, …, 800] × JPEG qualities [85, …, 35]: the first that fits."""
    from PIL import Image
    base = _flatten(img)
    long_edge = max(w, h)
    sides = sorted({min(s, limit, long_edge) for s in (limit, *SIDES)}, reverse=True)
    smallest = None
    for side in sides:
        scale = side / long_edge
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        # Lanczos; reducing_gap=3 first box-reduces by an integer factor (results indistinguishable, much faster)
        resized = base if size == base.size else base.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
        for q in QUALITIES:
            out = _encode_jpeg(resized, q)
            n64 = _b64len(len(out))
            if n64 <= p.max_b64_bytes:
                return ImageResult("resize", data=base64.b64encode(out).decode("ascii"), media_type="image/jpeg",
                                   width=resized.width, height=resized.height, nbytes=len(out))
            smallest = n64 if smallest is None else min(smallest, n64)
    return ImageResult(
        "omit", media_type=sniffed, width=w, height=h,
        reason=f"could not be reduced below {_mb(p.max_b64_bytes)} MB (got {(smallest or 0) / MIB:.2f} MB)",
    )


def fit_key(p: Images) -> tuple[Any, ...]:
    """The params a single image's result depends on (not the per-request ones), plus the encoder."""
    return (p.mode, p.max_side_px, p.target_max_side_px, p.max_b64_bytes, p.max_input_b64_bytes, p.max_pixels,
            ENCODER_VERSION)


class _Memo:
    """Results by sha256(input) + declared type + fit params + encoder, bounded by payload bytes.

    A re-encoded output is recorded as well (as `keep`: it fits the same params by construction),
    so a second pass over the layer's own output decodes nothing. Misses are computed in a thread
    pool (Pillow releases the GIL while decoding, resizing and encoding); each result depends only
    on its own input, so the output does not depend on scheduling."""

    def __init__(self, max_bytes: int = 512 * MIB, workers: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.workers = workers or min(16, os.cpu_count() or 1)
        self.items: OrderedDict[tuple[Any, ...], ImageResult] = OrderedDict()
        self.size = 0
        self.hits = 0
        self.misses = 0

    def _put(self, key: tuple[Any, ...], res: ImageResult) -> None:
        if key in self.items:
            return
        self.items[key] = res
        self.size += len(res.data or "") + 256
        while self.size > self.max_bytes and len(self.items) > 1:
            _, old = self.items.popitem(last=False)
            self.size -= len(old.data or "") + 256

    def _store(self, key: tuple[Any, ...], res: ImageResult) -> None:
        self._put(key, res)
        if res.status == "resize" and res.data is not None:
            self._put((sha256_hex(res.data), res.media_type, key[2]),
                      ImageResult("keep", media_type=res.media_type, width=res.width, height=res.height,
                                  nbytes=res.nbytes))

    def get(self, data: str | None, declared: str | None, p: Images) -> ImageResult:
        return self.get_many([(data, declared)], p)[0]

    def get_many(self, items: list[tuple[str | None, str | None]], p: Images) -> list[ImageResult]:
        fk = fit_key(p)
        keys = [(None if d is None else sha256_hex(d), m, fk) for d, m in items]
        todo: dict[tuple[Any, ...], tuple[str | None, str | None]] = {}
        for key, item in zip(keys, items):
            if key in self.items:
                self.hits += 1
                self.items.move_to_end(key)
            elif key not in todo:
                todo[key] = item
        if todo:
            self.misses += len(todo)
            pending = list(todo.items())
            if len(pending) > 1 and self.workers > 1:
                with ThreadPoolExecutor(max_workers=min(self.workers, len(pending))) as pool:
                    results = list(pool.map(lambda kv: fit_image(kv[1][0], kv[1][1], p), pending))
            else:
                results = [fit_image(d, m, p) for _, (d, m) in pending]
            fresh = {}
            for (key, _), res in zip(pending, results):
                self._store(key, res)
                fresh[key] = res
        out = []
        for key in keys:
            res = self.items.get(key)
            out.append(res if res is not None else fresh[key])
        return out

    def clear(self) -> None:
        self.items.clear()
        self.size = self.hits = self.misses = 0


MEMO = _Memo()


@functools.cache
def _result_dtype() -> pl.Struct:
    return pl.Struct({
        "status": pl.String, "data": pl.String, "media_type": pl.String, "width": pl.Int32, "height": pl.Int32,
        "nbytes": pl.Int64, "reason": pl.String,
    })



def _fit_batch(p: Images):
    def run(s: pl.Series) -> pl.Series:
        df = s.struct.unnest()
        mask = df.get_column("is_image").fill_null(False)
        out: list[dict[str, Any] | None] = [None] * df.height
        if mask.any():
            sub = df.filter(mask)
            results = MEMO.get_many(list(zip(sub.get_column("image_data").to_list(),
                                             sub.get_column("image_media_type").to_list())), p)
            for i, res in zip(mask.arg_true().to_list(), results):
                out[i] = {"status": res.status, "data": res.data, "media_type": res.media_type, "width": res.width,
                          "height": res.height, "nbytes": res.nbytes, "reason": res.reason}
        return pl.Series(out, dtype=_result_dtype())

    return run


# ----------------------------------------------------------------------------- too many images


def _stale_batch(max_images: int, keep_turns: int):
    """Per row: the call from which this image becomes STALE (null: never).

    A causal scan per thread over the calls at which images appear: at call k, if the images still
    present exceed `max_images`, every image outside the last `keep_turns` completed turns is
    replaced from k on, then the oldest remaining ones until the count fits. What is replaced
    stays replaced (the frontier only moves forward)."""

    def run(s: pl.Series) -> pl.Series:
        df = s.struct.unnest().with_row_index("_row")
        out: list[int | None] = [None] * df.height
        images = df.filter(pl.col("is_image"))
        if images.is_empty():
            return pl.Series(out, dtype=pl.Int32)
        counts = images.group_by("session_id", "thread_id").len().filter(pl.col("len") > max_images)
        if counts.is_empty():
            return pl.Series(out, dtype=pl.Int32)
        over = df.join(counts.select("session_id", "thread_id"), on=["session_id", "thread_id"], how="semi")
        for thread in over.partition_by("session_id", "thread_id"):
            # current turn at call k: the highest turn index among rows visible by then
            turn_steps = thread.group_by("first_call").agg(pl.col("turn").max()).sort("first_call")
            step_calls = turn_steps["first_call"].to_list()
            step_turns = turn_steps["turn"].cum_max().to_list()
            imgs = thread.filter(pl.col("is_image")).sort("order_key", "block_pos", "part_pos", "first_call")
            row, first, end, turn = (imgs[c].to_list() for c in ("_row", "first_call", "end", "turn"))
            never = 1 << 62
            enter = sorted((f, i) for i, f in enumerate(first))
            leave = sorted((e if e is not None else never, i) for i, e in enumerate(end))
            # the state carried from call to call: images visible and not yet replaced (positions in
            # image order). A replacement holds for every later call, so this is a forward scan over
            # the calls at which images appear; each step touches only the images entering,
            # leaving or being replaced there.
            active: list[int] = []
            pe = pl_ = 0
            for k in sorted(set(first)):
                while pe < len(enter) and enter[pe][0] <= k:
                    bisect.insort(active, enter[pe][1])
                    pe += 1
                while pl_ < len(leave) and leave[pl_][0] <= k:
                    j = bisect.bisect_left(active, leave[pl_][1])
                    if j < len(active) and active[j] == leave[pl_][1]:
                        del active[j]
                    pl_ += 1
                if len(active) <= max_images:
                    continue
                i = bisect.bisect_right(step_calls, k) - 1
                oldest_kept = (step_turns[i] if i >= 0 else 0) - keep_turns
                rest = [x for x in active if turn[x] >= oldest_kept]
                rest = rest[max(0, len(rest) - max_images):]  # then the oldest until the count fits
                keep = set(rest)
                for x in active:
                    if x not in keep:
                        out[row[x]] = k
                active = rest
        return pl.Series(out, dtype=pl.Int32)

    return run


# ----------------------------------------------------------------------------- the stage


def _as_text(text: pl.Expr) -> dict[str, pl.Expr]:
    """An image block or image part that becomes text (a tool_result part stays a part)."""
    in_result = pl.col("block_type") == "tool_result"
    return {
        "block_type": pl.when(in_result).then(pl.lit("tool_result")).otherwise(pl.lit("text")),
        "part_type": pl.when(in_result).then(pl.lit("text")).otherwise(pl.lit(None, pl.String)),
        "text": text,
        "image_media_type": pl.lit(None, pl.String),
        "image_data": pl.lit(None, pl.String),
        "image_bytes": pl.lit(None, pl.Int64),
        "image_width": pl.lit(None, pl.Int32),
        "image_height": pl.lit(None, pl.Int32),
    }


def _image_row(r: dict[str, Any]) -> bool:
    return r["block_type"] == "image" or r["part_type"] == "image" or r["image_data"] is not None


def live_start(thread: LiveThread, params: Images, ctx: StageContext) -> int:
    """The live rule carries the thread's image rows (as loaded)."""
    image = (pl.col("block_type") == "image") | (pl.col("part_type") == "image") | pl.col("image_data").is_not_null()
    return thread.loaded.filter(image.fill_null(False)).height


def live_step(carry: int, new: LiveRows, params: Images, ctx: StageContext) -> Live:
    """Quiet when no new row holds an image and the thread's images are within max_images_per_request."""
    if any(_image_row(r) for r in new.rows):
        return Live.full_pass("an image")
    if carry > params.max_images_per_request:
        return Live.full_pass("more images in the thread than max_images_per_request")
    return Live.quiet(carry)


def quiet_check(blocks: pl.LazyFrame, params: Images, ctx: StageContext) -> pl.Expr:
    """Nothing to do (ctxreplay.pipeline.stageapi.quiet): no image row, so nothing to measure, cap,
    omit or make stale."""
    return ~((pl.col("block_type") == "image") | (pl.col("part_type") == "image")).fill_null(False).any()


@stage("images", version=1, params=Images, encoder_version=ENCODER_VERSION, live=LiveRule(live_start, live_step),
       quiet=Quiet(quiet_check))
def images(blocks: pl.LazyFrame, params: Images, ledger: pl.LazyFrame, ctx: StageContext) -> StageResult:
    """Cap, re-encode or omit images (user, assistant and tool-result images); replace images of old
    turns when a request holds too many.

    Decisions: `image_resize`, `image_media_type` (sniffed type differs from the declared one),
    `image_omitted`, `image_stale` (from the call where the request exceeded the count),
    `image_input_unsupported`. Measured width, height and byte size are filled in for every image
    decoded; that alone is not a decision.
    """
    is_image = (
        ((pl.col("block_type") == "image") | ((pl.col("block_type") == "tool_result") & (pl.col("part_type") == "image")))
        & (pl.col("role") != "system")
    )
    # an image given by URL (no inline data) is sent as it is
    by_url = pl.col("image_data").is_null() & pl.col("extra_json").str.contains('"url"', literal=True).fill_null(False)
    w = start_marks(blocks).with_columns(_is_image=is_image.fill_null(False) & alive() & ~by_url)
    if not ctx.supports_images:
        w = mark_replace(w, pl.col("_is_image"), _as_text(pl.lit(NO_IMAGE_INPUT)), "image_input_unsupported")
        return finish(w)

    return finish(_mark_stale(_mark_fit(w, params), params))


def _mark_fit(w: pl.LazyFrame, params: Images) -> pl.LazyFrame:
    """First sight: one decision per payload, from the block's first call (measured sizes filled in)."""
    fit = pl.struct(
        is_image=pl.col("_is_image"), image_data=pl.col("image_data"), image_media_type=pl.col("image_media_type")
    ).map_batches(_fit_batch(params), return_dtype=_result_dtype())
    w = w.with_columns(_fit=fit).with_columns(
        _status=pl.col("_fit").struct.field("status"),
        _new_data=pl.col("_fit").struct.field("data"),
        _new_type=pl.col("_fit").struct.field("media_type"),
        _reason=pl.col("_fit").struct.field("reason"),
    )
    measured = pl.col("_is_image") & pl.col("_status").is_in(["keep", "fix_type", "resize"])
    w = w.with_columns(
        image_width=pl.when(measured).then(pl.col("_fit").struct.field("width")).otherwise(pl.col("image_width")),
        image_height=pl.when(measured).then(pl.col("_fit").struct.field("height")).otherwise(pl.col("image_height")),
        image_bytes=pl.when(measured).then(pl.col("_fit").struct.field("nbytes")).otherwise(pl.col("image_bytes")),
    )
    w = mark_replace(w, pl.col("_status") == "fix_type", {"image_media_type": pl.col("_new_type")}, "image_media_type")
    w = mark_replace(
        w, pl.col("_status") == "resize",
        {"image_data": pl.col("_new_data"), "image_media_type": pl.col("_new_type")}, "image_resize",
    )
    return mark_replace(
        w, pl.col("_status") == "omit",
        _as_text(pl.format(polars_format(OMITTED), pl.col("_reason"))), "image_omitted",
    )


def _mark_stale(w: pl.LazyFrame, params: Images) -> pl.LazyFrame:
    """Per call: too many images in one request; an image goes stale from that call (in place when
    that is its first call, else as a new version from there)."""
    still_image = pl.col("_is_image") & (pl.col("_status") != "omit")
    w = w.with_columns(
        _real_user_start=pl.col("_is_first_row") & (pl.col("role") == "user")
        & ~(pl.col("block_type") == "tool_result").any().over(MSG_NO),
    ).with_columns(
        _turn=pl.col("_real_user_start").cast(pl.Int32).cum_sum().over(THREAD_NO),
    )
    stale = pl.struct(
        session_id=pl.col("session_id"), thread_id=pl.col("thread_id"), is_image=still_image,
        first_call=pl.col("first_call"), end=cover_end(), turn=pl.col("_turn"),
        order_key=pl.col("order_key"), block_pos=pl.col("block_pos"), part_pos=pl.col("part_pos"),
    ).map_batches(_stale_batch(params.max_images_per_request, params.keep_recent_image_turns), return_dtype=pl.Int32)
    w = w.with_columns(_stale_from=stale)
    return mark_replace_from(w, pl.col("_stale_from").is_not_null(), _as_text(pl.lit(STALE)), "image_stale",
                             pl.col("_stale_from"))
