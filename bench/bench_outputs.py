"""What writing a run's outputs costs per Parquet compression: each output file of OUT (a finished
`ctxreplay run --out OUT`) read back and written again, row group by row group with the writer
options the run uses (batchout: statistics, dictionary columns), under snappy (the writer's
default, what ctxreplay wrote before) and under batchout.COMPRESSION (zstd, level 1). Prints, per
file and codec, the best CPU and wall milliseconds of --repeat writes and the bytes written, then
the time to read the written file back.

    python bench/bench_outputs.py OUT [--repeat 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq

from ctxreplay.pipeline.batch.batchout import COMPRESSION, SHARED, dictionary_columns, statistics_columns

CODECS = {"snappy": {"compression": "snappy"}, "zstd-1 (ours)": COMPRESSION}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the --out of a finished run")
    ap.add_argument("--repeat", type=int, default=4)
    a = ap.parse_args()
    files = sorted((a.out / "current").glob("*.parquet")) if (a.out / "current").exists() else sorted(a.out.glob("*.parquet"))
    with tempfile.TemporaryDirectory(prefix="bench-outputs-") as tmp:
        dest = Path(tmp) / "f.parquet"
        print(f"{'file':24s} {'codec':14s} {'cpu ms':>8s} {'wall ms':>8s} {'MB':>7s} {'read ms':>8s}")
        total: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in CODECS}
        for path in files:
            f = pq.ParquetFile(path, read_dictionary=sorted(SHARED & set(pq.read_schema(path).names)))
            tables = [f.read_row_group(i) for i in range(f.num_row_groups)]
            schema = f.schema_arrow
            for name, codec in CODECS.items():
                cpu = wall = float("inf")
                for _ in range(a.repeat):
                    c0, w0 = time.process_time(), time.perf_counter()
                    with pq.ParquetWriter(dest, schema, write_statistics=statistics_columns(schema),
                                          use_dictionary=dictionary_columns(schema), **codec) as w:
                        for t in tables:
                            w.write_table(t, row_group_size=max(t.num_rows, 1))
                    cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - w0)
                size = os.path.getsize(dest)
                r0 = time.perf_counter()
                pq.read_table(dest)
                read = time.perf_counter() - r0
                for i, v in enumerate((cpu, wall, size)):
                    total[name][i] += v
                print(f"{path.name:24s} {name:14s} {cpu * 1000:8.0f} {wall * 1000:8.0f} {size / 1e6:7.1f} {read * 1000:8.0f}")
        for name, (cpu, wall, size) in total.items():
            print(f"{'all':24s} {name:14s} {cpu * 1000:8.0f} {wall * 1000:8.0f} {size / 1e6:7.1f}")


if __name__ == "__main__":
    main()
