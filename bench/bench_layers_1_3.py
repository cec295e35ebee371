"""Benchmark of context layers 1–3 (sanitize, inter_session, images). Prints figures; not a test.

    python bench/bench_layers_1_3.py [--corpus ../shared/corpus] [--images 100] [--repeat 3]

1. The corpus (when present): load it once, then time each layer on the blocks (a second pass,
   which must decide nothing, is timed too) and list the decisions by reason.
2. A generated image-heavy session: `--images` user turns, each with one image of a realistic mix
   (screenshots within the caps, 2560 px screenshots and 4032 px photos over them, a few corrupt
   ones); the images layer is timed cold (memo cleared: every image decoded, oversized ones
   re-encoded) and warm (memoised), and images/s printed.
"""

from __future__ import annotations

import argparse
import base64
import io
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ctxreplay.pipeline.core.blockops import empty_decisions
from ctxreplay.pipeline.stageapi.registry import StageContext, get_stage
from ctxreplay.pipeline.staging.spec import resolve_params
from ctxreplay.stages.images import ENCODER_VERSION, MEMO
from ctxreplay.testkit import make_blocks

LAYERS = ("sanitize", "inter_session", "images")


ENGINE = "auto"


def run_layer(name: str, blocks: pl.DataFrame, params: dict[str, Any] | None = None) -> tuple[pl.DataFrame, pl.DataFrame, float]:
    out, dec, wall, _ = run_layer_cpu(name, blocks, params)
    return out, dec, wall


def run_layer_cpu(name: str, blocks: pl.DataFrame, params: dict[str, Any] | None = None
                  ) -> tuple[pl.DataFrame, pl.DataFrame, float, float]:
    """Run one layer and collect both outputs; returns (blocks, decisions, wall s, CPU s of all threads)."""
    st = get_stage(name)
    p = resolve_params(st, dict(params or {}), where=f"bench ({name})")
    t0, c0 = time.perf_counter(), time.process_time()
    res = st.fn(blocks.lazy(), p, empty_decisions(), StageContext())
    out, dec = pl.collect_all([res.blocks, res.decisions], engine=ENGINE)  # type: ignore[arg-type]
    return out, dec, time.perf_counter() - t0, time.process_time() - c0


def bench_corpus(corpus: Path, repeat: int) -> None:
    try:
        from ctxreplay.pipeline.loaders import load_paths
    except ImportError:
        print("corpus: skipped (ctxreplay.pipeline.loaders.load_paths is not available yet)")
        return
    if not corpus.is_dir():
        print(f"corpus: skipped ({corpus} not found)")
        return
    t0 = time.perf_counter()
    blocks = pl.from_arrow(load_paths([corpus]).blocks)
    assert isinstance(blocks, pl.DataFrame)
    print(f"corpus: {blocks.height:,} block rows, {blocks.select('session_id', 'thread_id').n_unique()} threads "
          f"(loaded in {time.perf_counter() - t0:.2f} s)")
    for name in LAYERS:
        best = cpu = float("inf")
        out = dec = blocks
        for _ in range(repeat):
            MEMO.clear()
            out, dec, dt, dc = run_layer_cpu(name, blocks, {})
            best, cpu = min(best, dt), min(cpu, dc)
        _, dec2, dt2 = run_layer(name, out, {})
        reasons = Counter(f"{a}:{r}" for a, r in dec.select("action", "reason").iter_rows())
        print(f"  {name:<14} {best * 1000:8.1f} ms wall {cpu * 1000:8.1f} ms CPU  {blocks.height / best:>9,.0f} rows/s"
              f"  decisions {dec.height:>4}  second pass {dt2 * 1000:6.1f} ms, {dec2.height} decisions")
        for k, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"      {n:>5}  {k}")
        blocks = out


def _screenshot(rng: random.Random, w: int, h: int) -> Any:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, h), (245, 245, 245))
    draw = ImageDraw.Draw(img)
    for _ in range(40):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        x1, y1 = min(w, x0 + rng.randrange(20, w // 3)), min(h, y0 + rng.randrange(8, h // 6))
        draw.rectangle((x0, y0, x1, y1), fill=tuple(rng.randrange(256) for _ in range(3)))
    for y in range(0, h, 18):
        draw.line((10, y, w - 10, y), fill=(200, 200, 200))
    return img


def _photo(rng: random.Random, w: int, h: int) -> Any:
    from PIL import Image

    small = Image.frombytes("RGB", (w // 16, h // 16), rng.randbytes((w // 16) * (h // 16) * 3))
    return small.resize((w, h), Image.Resampling.BICUBIC)


def image_session(n: int, seed: int = 7) -> tuple[list[dict[str, Any]], Counter[str]]:
    """n user turns with one image each (a deterministic mix) and an assistant answer after each."""
    rng = random.Random(seed)
    kinds: Counter[str] = Counter()
    msgs: list[dict[str, Any]] = []
    for i in range(n):
        r = i % 10
        buf = io.BytesIO()
        if r < 5:
            _screenshot(rng, 1280, 800).save(buf, format="PNG")
            kind, media = "screenshot 1280x800 (within caps)", "image/png"
        elif r < 8:
            _screenshot(rng, 2560, 1440).save(buf, format="PNG")
            kind, media = "screenshot 2560x1440 (over max side)", "image/png"
        elif r < 9:
            _photo(rng, 4032, 3024).save(buf, format="JPEG", quality=92)
            kind, media = "photo 4032x3024 jpeg (over max side)", "image/jpeg"
        else:
            _screenshot(rng, 640, 480).save(buf, format="PNG")
            raw = buf.getvalue()
            buf = io.BytesIO(raw[: len(raw) // 2])
            kind, media = "truncated png (corrupt)", "image/png"
        kinds[kind] += 1
        data = base64.b64encode(buf.getvalue()).decode()
        msgs.append({"role": "user", "blocks": [{"type": "text", "text": f"look at #{i}"},
                                                {"type": "image", "image_media_type": media, "image_data": data}]})
        msgs.append({"role": "assistant", "text": f"seen #{i}", "provider": "anthropic", "api": "anthropic-messages"})
    return msgs, kinds


def bench_images(n: int, repeat: int) -> None:
    t0 = time.perf_counter()
    msgs, kinds = image_session(n)
    blocks = make_blocks(msgs).collect()
    b64 = blocks.filter(pl.col("block_type") == "image")["image_data"].str.len_bytes().sum()
    print(f"\nimage-heavy session: {n} images, {b64 / 1e6:.1f} MB of base64 (generated in {time.perf_counter() - t0:.1f} s)")
    for k, c in sorted(kinds.items()):
        print(f"      {c:>5}  {k}")
    cold = []
    for _ in range(repeat):
        MEMO.clear()
        out, dec, dt = run_layer("images", blocks)
        cold.append(dt)
    warm = [run_layer("images", blocks)[2] for _ in range(repeat)]
    _, dec2, dt2 = run_layer("images", out)
    reasons = Counter(f"{a}:{r}" for a, r in dec.select("action", "reason").iter_rows())
    print(f"  images cold   {min(cold):7.2f} s  {n / min(cold):8.1f} images/s  (every image decoded, oversized re-encoded)")
    print(f"  images warm   {min(warm):7.2f} s  {n / min(warm):8.1f} images/s  (memoised by sha256 + params)")
    print(f"  second pass   {dt2:7.2f} s  {dec2.height} decisions")
    for k, c in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"      {c:>5}  {k}")
    sent = out.filter(pl.col("block_type") == "image")
    print(f"  after: {sent.height} images, largest base64 {sent['image_data'].str.len_bytes().max():,} bytes, "
          f"longest side {max(sent['image_width'].max() or 0, sent['image_height'].max() or 0)} px")
    # the three layers in order on the same session
    MEMO.clear()
    t = time.perf_counter()
    cur = blocks
    for name in LAYERS:
        cur, _, _ = run_layer(name, cur)
    dt = time.perf_counter() - t
    print(f"  sanitize → inter_session → images (cold): {dt:.2f} s, {n / dt:.1f} images/s")
    # more images than max_images_per_request: the per-call scan replaces old turns' images
    _, dec_many, dt_many = run_layer("images", blocks, {"max_images_per_request": max(1, n // 4)})
    stale = dec_many.filter(pl.col("reason") == "image_stale").height
    print(f"  with max_images_per_request={max(1, n // 4)} (warm): {dt_many:.2f} s, {stale} images made stale")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "corpus")
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--engine", choices=["auto", "streaming", "in-memory"], default="auto",
                    help="polars engine for collect (the runner uses the default)")
    args = ap.parse_args()
    global ENGINE
    ENGINE = args.engine
    print(f"polars {pl.__version__}, engine {ENGINE}, {ENCODER_VERSION}, image threads {MEMO.workers}")
    bench_corpus(args.corpus, args.repeat)
    bench_images(args.images, args.repeat)


if __name__ == "__main__":
    main()
