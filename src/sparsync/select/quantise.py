"""Low-bit values with a per-tensor table, and fixed-width bit packing for codes and chunk-local indices.

SparseLoCo (Sarfi et al., arXiv 2508.15706, 2025) sends its selected values in 2 bits: 4 bins over
+-6 sigma, each decoded to a per-tensor table entry. :func:`quantise` does that for ``bits`` in 2, 4, 8:

* ``sigma`` is the RMS of the selected values, ``L = 6 sigma``; the ``2^bits`` bins cut ``[-L, L]``
  evenly (values beyond it fall in the outer bins), and a value's code is its bin;
* the table holds, per bin, the **mean of the values in that bin** (0 for an empty bin): the decode
  with the least squared error for these bins, so a value and its decode lie in the same bin (and
  have the same sign: an even count of bins over a symmetric range has an edge at zero; a value that
  rounds onto zero falls in the bin above it);
* the decoded values are what travels in effect; the caller keeps ``value - decode`` in its residual
  (error feedback), so nothing is lost, only delayed.

Everything is deterministic torch arithmetic on the sender's values; receivers use the sender's table.
``bits`` 16 / 32 send fp16 / fp32 values (no table). :func:`pack_bits` / :func:`unpack_bits` put
non-negative integers of ``width`` bits next to each other, little-endian within the byte stream
(two 12-bit chunk-local indices in 3 bytes, four 2-bit codes in a byte): vectorised, a group of values
per int64 word where ``lcm(width, 8) <= 56``, else a ``[m, width]`` bit matrix. :func:`encode_message` /
:func:`decode_message` are one rank's whole message: the packed positions, then the values (packed codes
and the table, or the fp16 / fp32 values: :func:`encode_values`), exactly :func:`payload_bytes` bytes.
"""

from __future__ import annotations

import math

import torch

from .. import native

__all__ = ["VALUE_BITS", "bits_for", "pack_bits", "unpack_bits", "quantise", "dequantise", "payload_bytes",
           "encode_values", "decode_values", "encode_message", "decode_message", "sum_messages",
           "check_value_bits"]

#: value widths: 2, 4, 8 bits with a table; 16 (fp16) and 32 (fp32) as they are
VALUE_BITS = (2, 4, 8, 16, 32)
#: the bins span +-RANGE_SIGMAS x the RMS of the values
RANGE_SIGMAS = 6.0
_FP16_MAX = 65504.0  # the largest finite float16
_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def check_value_bits(bits, who: str) -> int:
    """``value_bits`` as an int of :data:`VALUE_BITS`, or a one-line ``ValueError`` naming ``who``."""
    if isinstance(bits, bool) or bits not in VALUE_BITS:
        raise ValueError(f"{who}: value_bits must be one of {', '.join(map(str, VALUE_BITS))}, got {bits!r}")
    return int(bits)


def bits_for(count: int) -> int:
    """Bits that hold every integer in ``[0, count)`` (at least 1)."""
    return max(1, (int(count) - 1).bit_length())


def _group(width: int) -> tuple[int, int] | None:
    """``(values, bytes)`` of the smallest whole group of ``width``-bit values (``lcm(width, 8)`` bits),
    when that fits one int64 word below its sign bit; else None (the bit-matrix form)."""
    span = math.lcm(int(width), 8)
    return (span // width, span // 8) if span <= 56 else None


def pack_bits(v: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 bytes holding the ``width``-bit integers ``v`` (``ceil(len(v) * width / 8)`` bytes).

    Value ``i`` is bits ``[i width, (i + 1) width)`` of the stream, byte ``j`` its bits ``[8 j, 8 j + 8)``,
    least significant first. Widths whose ``lcm(width, 8)`` is at most 56 bits (1-8, 10, 12, 14, 16,
    20, 24, 28, 32 ...) go a group at a time - ``lcm / width`` values shifted into one int64 word, cut
    into ``lcm / 8`` bytes: about 3 int64 temporaries per value - the others through a ``[m, width]``
    bit matrix."""
    v = v.reshape(-1).to(torch.int64)
    m, grp = v.numel(), _group(width)
    if grp is None:
        return _pack_matrix(v, width)
    g, nb = grp
    if m % g:
        v = torch.cat([v, v.new_zeros(g - m % g)])
    word = (v.view(-1, g) << torch.arange(0, g * width, width, device=v.device)).sum(dim=1, keepdim=True)
    out = ((word >> torch.arange(0, 8 * nb, 8, device=v.device)) & 255).to(torch.uint8).reshape(-1)
    return out[: -(-m * width // 8)]


def unpack_bits(b: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` integers of ``width`` bits in ``b`` (:func:`pack_bits`'s inverse), int64."""
    grp = _group(width)
    if grp is None:
        return _unpack_matrix(b, width, count)
    g, nb = grp
    b = b.reshape(-1)[: -(-count * width // 8)].to(torch.int64)
    if b.numel() % nb:
        b = torch.cat([b, b.new_zeros(nb - b.numel() % nb)])
    word = (b.view(-1, nb) << torch.arange(0, 8 * nb, 8, device=b.device)).sum(dim=1, keepdim=True)
    vals = (word >> torch.arange(0, g * width, width, device=b.device)) & ((1 << width) - 1)
    return vals.reshape(-1)[:count]


def _pack_matrix(v: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`pack_bits` through a ``[m, width]`` bit matrix (any width)."""
    shifts = torch.arange(width, dtype=torch.int64, device=v.device)
    bits = ((v.reshape(-1, 1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) * _WEIGHTS.to(v.device)).sum(dim=1, dtype=torch.int64).to(torch.uint8)


def _unpack_matrix(b: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """:func:`unpack_bits` through the bit matrix (any width)."""
    bits = ((b.to(torch.int64).unsqueeze(1) >> torch.arange(8, device=b.device)) & 1).reshape(-1)
    bits = bits[: count * width].view(count, width)
    return (bits << torch.arange(width, device=b.device)).sum(dim=1)


def quantise(vals: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, table)``: int64 bin codes of ``vals`` and the float32 table of bin means (module
    docstring); ``table[codes]`` is the decode."""
    v = vals.to(torch.float64)  # (bins and means in float64: values near fp32's limit do not overflow)
    nbins = 1 << bits
    rms = float(v.square().mean().sqrt()) if v.numel() else 0.0
    if rms == 0.0:
        return torch.zeros(v.numel(), dtype=torch.int64, device=v.device), torch.zeros(nbins, device=v.device)
    lim = RANGE_SIGMAS * rms
    codes = torch.floor((v + lim) * (nbins / (2 * lim))).clamp_(0, nbins - 1).to(torch.int64)
    sums = torch.zeros(nbins, dtype=torch.float64, device=v.device).index_add_(0, codes, v)
    counts = torch.bincount(codes, minlength=nbins).to(torch.float64)
    return codes, (sums / counts.clamp(min=1)).to(torch.float32)


def dequantise(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, codes)


def payload_bytes(count: int, index_width: int, bits: int, per: int = 1) -> int:
    """Bytes of one rank's message: ``count`` packed indices, their ``count * per`` values (codes + a
    float32 table of ``2^bits`` entries, or fp16 / fp32 values; ``per``: values per position, a block's size)."""
    idx = -(-count * index_width // 8)
    count *= per
    if bits >= 16:
        return idx + count * bits // 8
    return idx + -(-count * bits // 8) + 4 * (1 << bits)


def encode_values(vals: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(msg, decode)``: the uint8 bytes of ``vals`` in ``bits`` (packed codes then the float32 table, or
    fp16 / fp32 values) and ``decode``, what every receiver decodes (in ``vals``' dtype: the sender keeps
    ``vals - decode`` in its residual). fp16 values saturate at +-65504 (the rest stays in the residual,
    finite); with a half-precision ``vals`` the table is rounded to that dtype before it is sent, so
    ``decode`` is exactly what the receivers add."""
    if bits >= 16:
        sent = vals.to(torch.float16 if bits == 16 else torch.float32)
        if bits == 16:  # the cast's infinities back to the largest finite fp16 (NaN stays NaN)
            sent.clamp_(-_FP16_MAX, _FP16_MAX)
        return sent.view(torch.uint8), sent.to(vals.dtype)
    codes, table = quantise(vals, bits)
    if vals.dtype in (torch.float16, torch.bfloat16):
        table = table.to(vals.dtype).to(torch.float32)
    return torch.cat([pack_bits(codes, bits), table.view(torch.uint8)]), dequantise(codes, table).to(vals.dtype)


def decode_values(v: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The ``count`` float32 values of :func:`encode_values`' bytes ``v`` (fp16 ones widened: no rounding)."""
    if bits >= 16:  # (a copy: aligned for the float view)
        return v.clone().view(torch.float16 if bits == 16 else torch.float32).to(torch.float32)
    nc = -(-count * bits // 8)
    return dequantise(unpack_bits(v[:nc], bits, count), v[nc:].clone().view(torch.float32))


def encode_message(where: torch.Tensor, width: int, vals: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(msg, decode)``: the uint8 message of positions ``where`` (integers below ``2^width``, packed)
    then :func:`encode_values` of ``vals`` (:func:`payload_bytes` bytes), and the values' ``decode``."""
    tail, dec = encode_values(vals, bits)
    return torch.cat([pack_bits(where, width), tail]), dec


def decode_message(msg: torch.Tensor, count: int, width: int, bits: int,
                   per: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(where, values)`` of :func:`encode_message`'s message of ``count`` positions and ``count * per``
    values (``per``: a block's size): int64 positions and float32 values."""
    ni = -(-count * width // 8)
    return unpack_bits(msg[:ni], width, count), decode_values(msg[ni:], count * per, bits)


def sum_messages(parts: list, count: int, width: int, bits: int, out: torch.Tensor,
                 chunk: int | None = None, k: int | None = None) -> torch.Tensor:
    """Add every rank's message (:func:`decode_message`) into ``out`` in rank order - one ``index_add_``
    each, so every rank that sums the same messages gets the same bits. ``chunk`` / ``k``: the indices
    are chunk-local, ``k`` entries per full chunk of ``chunk`` (the rest in the short last chunk), and
    entry ``p`` lands at its chunk's start plus its index; else they are global. With the C kernels
    (2, 4, 8-bit values, a fp32 ``out``) each message is unpacked and added in one loop
    (:func:`sparsync.native.add_packed`, the same bits)."""
    n = out.numel()
    span, per = (chunk, k) if chunk is not None else (max(n, 1), max(count, 1))
    if bits < 16 and width <= 24 and native.usable(out) and out.dim() == 1:
        for m in parts:
            if not native.add_packed(out, m.contiguous(), count, span, per, width, bits):
                raise ValueError(f"a message's index lies outside the {n} entries")
        return out
    base = None
    if chunk is not None:
        base = (torch.arange(count, device=out.device) // k).clamp_(max=n // chunk) * chunk
    for m in parts:
        where, v = decode_message(m, count, width, bits)
        out.index_add_(0, where if base is None else base + where, v.to(out.dtype))
    return out
