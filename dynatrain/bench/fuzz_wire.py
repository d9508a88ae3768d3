"""Protobuf on the wire, below the library: records split and mutated as bytes.

The wire side of :mod:`.fuzz`: :func:`varint`, :func:`split_records` (a message cut into its
top-level field records) and :func:`mutate` (one wire-level change of a valid message: bit
flips, truncation, duplicated, dropped or reordered records, unknown fields, bad lengths and
wire types). Separate because it knows no Agent message and no gRPC: plain functions of bytes
and a random generator, which the case generator (:mod:`.fuzz_cases`) builds ``mutated`` and
``garbage`` requests with.
"""

from __future__ import annotations

import random


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("bad varint")
        b = data[i]
        n |= (b & 0x7F) << shift
        i += 1
        shift += 7
        if not b & 0x80:
            return n, i


def split_records(data: bytes) -> list[bytes] | None:
    """The field records (key and value bytes) of a serialized message; None if it is not
    one (groups and odd wire types included)."""
    out, i = [], 0
    try:
        while i < len(data):
            start = i
            key, i = _read_varint(data, i)
            wire = key & 7
            if wire == 0:
                _, i = _read_varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 2:
                n, i = _read_varint(data, i)
                i += n
            elif wire == 5:
                i += 4
            else:
                return None
            if i > len(data):
                return None
            out.append(data[start:i])
    except ValueError:
        return None
    return out


def mutate(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """One wire-level mutation of ``data``: (its name, the bytes)."""
    records = split_records(data) or []
    how = rng.choice(("flip", "truncate", "duplicate", "drop", "shuffle", "unknown", "length",
                      "wiretype", "splice", "varint"))
    if how == "flip" or not records and how not in ("unknown", "truncate"):
        b = bytearray(data or b"\x00")
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return "flip", bytes(b)
    if how == "truncate":
        return how, data[:rng.randrange(len(data))] if data else b""
    if how == "duplicate":
        i = rng.randrange(len(records))
        records.insert(rng.randrange(len(records) + 1), records[i])
    elif how == "drop":
        records.pop(rng.randrange(len(records)))
    elif how == "shuffle":
        rng.shuffle(records)
    elif how == "unknown":
        number = rng.choice((16, 99, 1000, 2**29 - 1, rng.randrange(16, 2**29)))
        wire = rng.choice((0, 1, 2, 5))
        value = {0: varint(rng.getrandbits(64)), 1: rng.randbytes(8), 5: rng.randbytes(4)}.get(
            wire) or varint(n := rng.randint(0, 64)) + rng.randbytes(n)
        records.insert(rng.randrange(len(records) + 1), varint(number << 3 | wire) + value)
    elif how == "length":
        # a length-delimited record whose length claims far more than follows
        i = rng.randrange(len(records))
        key, j = _read_varint(records[i], 0)
        records[i] = varint((key & ~7) | 2) + varint(rng.choice((2**31, 2**32 + 5, 2**63,
                                                                 len(data) + 1))) + b"x"
    elif how == "wiretype":
        i = rng.randrange(len(records))
        key, j = _read_varint(records[i], 0)
        records[i] = varint((key & ~7) | rng.choice((1, 2, 3, 4, 5, 6, 7))) + records[i][j:]
    elif how == "splice":
        records = records[:rng.randrange(len(records) + 1)] + rng.sample(
            records, rng.randint(1, len(records)))
    elif how == "varint":
        # a ten-byte varint that never ends, inside a record
        i = rng.randrange(len(records))
        key, j = _read_varint(records[i], 0)
        records[i] = records[i][:j] + b"\xff" * rng.randint(10, 12)
    return how, b"".join(records)
