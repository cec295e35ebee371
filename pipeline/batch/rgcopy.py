"""Parquet row groups copied from one file into another without decoding them (issue 22, item 4).

A re-run writes every output file again, but a batch whose groups are all reused has the same
rows as in the previous run's files, in the same row group. Its row groups are copied here as
bytes (their column chunks), beside the row groups this run encodes, and the file's footer is
written anew with the copied chunks' offsets moved to where they now lie. The footer is Parquet's
FileMetaData, Thrift compact protocol; this module reads and writes that protocol generically
(fields kept as they were, whatever their meaning) and touches only the offsets, the row groups'
ordinals and the file's row count. Anything it does not expect (a page index or bloom filter
outside the row group, column chunks that are not contiguous, another schema) makes `splice`
return False, and the caller writes the rows the ordinary way.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"PAR1"

# compact protocol types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


class _Unexpected(Exception):
    """A footer this module does not copy from (the caller falls back to re-encoding)."""


# ------------------------------------------------------------------------------ compact protocol


@dataclass
class Struct:
    """A Thrift struct as its fields in order: (field id, compact type, value)."""

    fields: list[list[Any]]

    def get(self, fid: int) -> Any:
        for f in self.fields:
            if f[0] == fid:
                return f[2]
        return None

    def has(self, fid: int) -> bool:
        return any(f[0] == fid for f in self.fields)

    def set(self, fid: int, value: Any) -> None:
        for f in self.fields:
            if f[0] == fid:
                f[2] = value
                return
        raise _Unexpected(f"no field {fid}")


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        data, pos = self.data, self.pos
        out, shift = 0, 0
        while True:
            b = data[pos]
            pos += 1
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                self.pos = pos
                return out
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, t: int) -> Any:
        if t in (_TRUE, _FALSE):  # inside a list or a map: a byte of its own
            return self.byte() == _TRUE
        if t == _BYTE:
            return self.byte()
        if t in (_I16, _I32, _I64):
            return self.zigzag()
        if t == _DOUBLE:
            v = self.data[self.pos:self.pos + 8]
            self.pos += 8
            return v
        if t == _BINARY:
            n = self.varint()
            v = self.data[self.pos:self.pos + n]
            self.pos += n
            return v
        if t in (_LIST, _SET):
            h = self.byte()
            n, et = h >> 4, h & 0x0F
            if n == 15:
                n = self.varint()
            return (et, [self.value(et) for _ in range(n)])
        if t == _MAP:
            n = self.varint()
            if not n:
                return (0, 0, [])
            kv = self.byte()
            kt, vt = kv >> 4, kv & 0x0F
            return (kt, vt, [(self.value(kt), self.value(vt)) for _ in range(n)])
        if t == _STRUCT:
            return self.struct()
        raise _Unexpected(f"thrift type {t}")

    def struct(self) -> Struct:
        fields: list[list[Any]] = []
        last = 0
        while True:
            h = self.byte()
            if h == 0:
                return Struct(fields)
            delta, t = h >> 4, h & 0x0F
            fid = last + delta if delta else self.zigzag()
            last = fid
            if t in (_TRUE, _FALSE):
                fields.append([fid, t, t == _TRUE])
            else:
                fields.append([fid, t, self.value(t)])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _value(t: int, v: Any, out: bytearray) -> None:
    if t in (_TRUE, _FALSE):
        out.append(_TRUE if v else _FALSE)
    elif t == _BYTE:
        out.append(v & 0xFF)
    elif t in (_I16, _I32, _I64):
        out += _zigzag(v)
    elif t == _DOUBLE:
        out += v
    elif t == _BINARY:
        out += _varint(len(v))
        out += v
    elif t in (_LIST, _SET):
        et, items = v
        if len(items) < 15:
            out.append(len(items) << 4 | et)
        else:
            out.append(0xF0 | et)
            out += _varint(len(items))
        for x in items:
            _value(et, x, out)
    elif t == _MAP:
        kt, vt, items = v
        out += _varint(len(items))
        if items:
            out.append(kt << 4 | vt)
            for k, x in items:
                _value(kt, k, out)
                _value(vt, x, out)
    elif t == _STRUCT:
        _struct(v, out)
    else:
        raise _Unexpected(f"thrift type {t}")


def _struct(s: Struct, out: bytearray) -> None:
    last = 0
    for fid, t, v in s.fields:
        ht = (_TRUE if v else _FALSE) if t in (_TRUE, _FALSE) else t
        if 0 < fid - last <= 15:
            out.append((fid - last) << 4 | ht)
        else:
            out.append(ht)
            out += _zigzag(fid)
        last = fid
        if t not in (_TRUE, _FALSE):
            _value(t, v, out)
    out.append(0)


def decode(data: bytes) -> Struct:
    r = _Reader(data)
    s = r.struct()
    if r.pos != len(data):
        raise _Unexpected("trailing bytes after the footer")
    return s


def encode(s: Struct) -> bytes:
    out = bytearray()
    _struct(s, out)
    return bytes(out)


# ------------------------------------------------------------------------------ Parquet footers

# FileMetaData: 2 schema, 3 num_rows, 4 row_groups, 5 key_value_metadata
# RowGroup: 1 columns, 2 total_byte_size, 3 num_rows, 5 file_offset, 6 total_compressed_size, 7 ordinal
# ColumnChunk: 1 file_path, 2 file_offset, 3 meta_data, 4-7 offset / column index
# ColumnMetaData: 7 total_compressed_size, 9 data_page_offset, 10 index_page_offset,
#                 11 dictionary_page_offset, 14 bloom_filter_offset, 15 bloom_filter_length


def footer(path: Path) -> tuple[Struct, int]:
    """The FileMetaData of a Parquet file and where it starts."""
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        if size < 12:
            raise _Unexpected("not a Parquet file")
        fh.seek(size - 8)
        n, magic = struct.unpack("<i4s", fh.read(8))
        if magic != MAGIC:
            raise _Unexpected("not a Parquet file (or an encrypted one)")
        fh.seek(size - 8 - n)
        return decode(fh.read(n)), size - 8 - n


def _span(rg: Struct) -> tuple[int, int]:
    """The byte range of a row group's column chunks (contiguous, in column order)."""
    start = end = None
    for cc in rg.get(1)[1]:
        if cc.get(1) is not None or any(cc.has(f) for f in (4, 5, 6, 7)):
            raise _Unexpected("a column chunk in another file, or a page index")
        md = cc.get(3)
        if md is None or md.has(14) or md.has(10):
            raise _Unexpected("a bloom filter or an index page")
        first = md.get(11) if md.get(11) is not None else md.get(9)
        if end is not None and first != end:
            raise _Unexpected("column chunks not contiguous")
        start = first if start is None else start
        end = first + md.get(7)
    if start is None:
        raise _Unexpected("a row group without columns")
    return start, end


def _moved(rg: Struct, delta: int, ordinal: int) -> Struct:
    """A row group's metadata with its offsets moved by `delta` bytes (in place: each row group
    of a decoded footer is copied once)."""
    for cc in rg.get(1)[1]:
        if cc.get(2):
            cc.set(2, cc.get(2) + delta)
        md = cc.get(3)
        for f in (9, 11):
            if md.get(f) is not None:
                md.set(f, md.get(f) + delta)
    if rg.get(5) is not None:
        rg.set(5, rg.get(5) + delta)
    if rg.has(7):
        rg.set(7, ordinal)
    return rg


def splice(dest: Path, base: Path, parts: list[tuple[Path, int]]) -> bool:
    """Write `dest`: the row groups `parts` (file, row group index) in that order, copied as bytes,
    under the footer of `base` (this run's schema and metadata) with their offsets moved. False
    (and no `dest`) when a file is not of the shape this copies: the caller writes the rows anew."""
    try:
        head, _ = footer(base)
        schema = encode(Struct([f for f in head.fields if f[0] == 2]))
        # the base's own row groups are moved in place: its footer's row groups are replaced below
        srcs: dict[Path, Struct] = {base: head}
        for p, _ in parts:
            if p not in srcs:
                srcs[p] = footer(p)[0]
                if encode(Struct([f for f in srcs[p].fields if f[0] == 2])) != schema:
                    raise _Unexpected("another schema")
        tmp = dest.with_name(f".{dest.name}.splice")
        if len(set(parts)) != len(parts):
            raise _Unexpected("a row group copied twice")
        groups, rows = [], 0
        with open(tmp, "wb") as out:
            out.write(MAGIC)
            for p, i in parts:
                rg = srcs[p].get(4)[1][i]
                start, end = _span(rg)
                with open(p, "rb") as src:
                    src.seek(start)
                    at = out.tell()
                    _copy(src, out, end - start)
                groups.append(_moved(rg, at - start, len(groups)))
                rows += rg.get(3)
            meta = Struct([list(f) for f in head.fields])
            meta.set(3, rows)
            if meta.has(4):
                meta.set(4, (_STRUCT, groups))
            else:
                raise _Unexpected("a footer without row groups")
            data = encode(meta)
            out.write(data)
            out.write(struct.pack("<i", len(data)) + MAGIC)
        os.replace(tmp, dest)
        return True
    except (_Unexpected, IndexError, KeyError, TypeError, struct.error):
        Path(dest.with_name(f".{dest.name}.splice")).unlink(missing_ok=True)
        return False


def _copy(src: Any, out: Any, n: int) -> None:
    """n bytes from src's position to out's: in the kernel where it can (no copy through Python)."""
    if hasattr(os, "copy_file_range"):
        out.flush()
        at, to = src.tell(), out.tell()
        try:
            while n:
                k = os.copy_file_range(src.fileno(), out.fileno(), n, at, to)
                if k <= 0:
                    break
                at, to, n = at + k, to + k, n - k
        except OSError:
            pass  # not supported between these files: the bytes that are left, the plain way
        src.seek(at)
        out.seek(to)
    while n:
        chunk = src.read(min(n, 1 << 22))
        if not chunk:
            raise _Unexpected("a file shorter than its footer says")
        out.write(chunk)
        n -= len(chunk)


__all__ = ["splice"]
