"""Parsing and formatting of physical quantities (bandwidth, sizes, times, FLOP/s).

Everything inside TAG is in base units: bytes, bytes/s, seconds, FLOP/s. These helpers convert
human strings such as ``"25 Gbit/s"``, ``"16 GiB"``, ``"20 us"`` or ``"15.7 TFLOPS"`` to base units
and back. Decimal prefixes (k, M, G, T, P) are powers of 1000, binary prefixes (Ki, Mi, Gi, Ti)
powers of 1024. Units are case-insensitive except for the single letter ``b``/``B``: ``b`` is a
bit and ``B`` a byte (``Gb/s`` = gigabits, ``GB/s`` = gigabytes); the words ``bit`` and ``byte``
may be written in any case. ``m`` means mega for sizes and bandwidths (milli makes no sense there).

Strings are parsed with :class:`fractions.Fraction`, so results are correctly rounded
(``"20 us"`` is exactly ``2e-05``). Errors are :class:`ValueError` with a one-line message.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

__all__ = [
    "parse_bandwidth",
    "parse_bytes",
    "parse_time",
    "parse_flops",
    "format_bandwidth",
    "format_bytes",
    "format_time",
    "format_flops",
    "format_count",
]

_NUMBER_RE = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*$")

# Prefix (lower-cased) -> multiplier. Decimal = powers of 1000, binary = powers of 1024.
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_PREFIXES = {**_DECIMAL, **_BINARY}

# Time units (lower-cased; both micro signs U+00B5 and U+03BC accepted) -> seconds as a Fraction.
_TIME_UNITS = {
    "s": Fraction(1),
    "sec": Fraction(1),
    "ms": Fraction(1, 10**3),
    "us": Fraction(1, 10**6),
    "\u00b5s": Fraction(1, 10**6),
    "\u03bcs": Fraction(1, 10**6),
    "ns": Fraction(1, 10**9),
}

_SIZE_RE = re.compile(r"^(?P<prefix>[kmgtp]i?|)(?P<base>bytes?|bits?|b)$", re.IGNORECASE)
_FLOPS_RE = re.compile(r"^(?P<prefix>[kmgtp]?)(?:flop/s|flops|flop/sec)$", re.IGNORECASE)


def _fmt_value(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Longest quantity string and largest decimal exponent parsed: "1e999999999" would make
# Fraction build a billion-digit integer; no physical quantity needs more than this.
_MAX_TEXT = 100  # characters
_MAX_EXPONENT = 400  # |e| in "1.5e<e>"; beyond ~308 the result overflows a double anyway


def _to_float(number: Fraction | int | float, original: object, kind: str) -> float:
    """``float(number)``, or a one-line ValueError when it does not fit a double (1e400 GB/s)."""
    try:
        return float(number)
    except OverflowError:
        raise ValueError(f"expected a finite {kind}, got {_fmt_value(original)} (too large)") from None


_EXAMPLE = {"bandwidth": "10 GB/s", "size": "16 GB", "time": "20 us", "compute rate": "15.7 TFLOP/s"}
"""An example string of each kind of quantity, for error messages."""


def _split(value: object, kind: str) -> tuple[Fraction, str] | float:
    """Return (number, unit) for a string, or the float for a plain number (base units)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a {kind} (number or string with unit), got {_fmt_value(value)}")
    if isinstance(value, (int, float)):
        return _to_float(value, value, kind)
    if not value.strip():
        raise ValueError(f"expected a {kind}, got an empty string")
    if len(value) > _MAX_TEXT:
        raise ValueError(f"expected a {kind} like {_EXAMPLE[kind]!r} (at most {_MAX_TEXT} characters), got {_fmt_value(value)}")
    match = _NUMBER_RE.match(value)
    if match is None:
        raise ValueError(f"expected a {kind} like {_EXAMPLE[kind]!r}, got {_fmt_value(value)}")
    exponent = re.search(r"[eE]([+-]?\d+)$", match.group(1))
    if exponent is not None and abs(int(exponent.group(1))) > _MAX_EXPONENT:
        raise ValueError(f"expected a finite {kind}, got {_fmt_value(value)} (exponent out of range)")
    return Fraction(match.group(1)), re.sub(r"\s+", "", match.group(2))


def _check(result: float, original: object, kind: str, positive: bool) -> float:
    if math.isnan(result) or math.isinf(result):
        raise ValueError(f"expected a finite {kind}, got {_fmt_value(original)}")
    if positive and result <= 0:
        raise ValueError(f"expected a positive {kind}, got {_fmt_value(original)}")
    if result < 0:
        raise ValueError(f"expected a non-negative {kind}, got {_fmt_value(original)}")
    return result


def _size_multiplier(unit: str, *, allow_bits: bool) -> Fraction | None:
    """Multiplier to bytes for a size unit such as 'GB', 'KiB', 'Gbit'; None if not a size unit."""
    match = _SIZE_RE.match(unit)
    if match is None:
        return None
    prefix, base = match.group("prefix").lower(), match.group("base")
    is_bits = base.lower().startswith("bit") or base == "b"
    if is_bits and not allow_bits:
        return None
    return Fraction(_PREFIXES[prefix], 8 if is_bits else 1)


def parse_bandwidth(value: object, *, positive: bool = True) -> float:
    """Parse a bandwidth such as ``"25 Gbit/s"``, ``"150 GB/s"``, ``"10 Gbps"`` to bytes/s."""
    split = _split(value, "bandwidth")
    if isinstance(split, float):
        return _check(split, value, "bandwidth", positive)
    number, unit = split
    mult = None
    lowered = unit.lower()
    for suffix in ("/s", "/sec", "ps"):
        if lowered.endswith(suffix):
            mult = _size_multiplier(unit[: -len(suffix)], allow_bits=True)
            break
    if mult is None:
        raise ValueError(
            f"unknown bandwidth unit {unit!r} in {_fmt_value(value)}; expected e.g. B/s, MB/s, GB/s, "
            "GiB/s, Mbit/s, Gbit/s, Gbps"
        )
    return _check(_to_float(number * mult, value, "bandwidth"), value, "bandwidth", positive)


def parse_bytes(value: object, *, positive: bool = True) -> int:
    """Parse a size such as ``"16 GB"`` or ``"32 GiB"`` to an integer number of bytes."""
    split = _split(value, "size")
    if isinstance(split, float):
        _check(split, value, "size", positive)
        exact = Fraction(value)  # int stays exact (beyond 2**53), float is rounded below
    else:
        number, unit = split
        mult = _size_multiplier(unit, allow_bits=False)
        if mult is None:
            hint = " ('b' means bits; write 'B' for bytes)" if unit.lower().endswith("b") else ""
            raise ValueError(
                f"unknown size unit {unit!r} in {_fmt_value(value)}{hint}; expected one of "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        exact = number * mult
        _check(_to_float(exact, value, "size"), value, "size", positive)
    rounded = round(exact)
    if positive and rounded <= 0:
        raise ValueError(f"expected a positive size of at least 1 byte, got {_fmt_value(value)}")
    return rounded


def parse_time(value: object, *, positive: bool = True) -> float:
    """Parse a duration such as ``"20 us"``, ``"1.5 ms"`` or ``"2 s"`` to seconds."""
    split = _split(value, "time")
    if isinstance(split, float):
        return _check(split, value, "time", positive)
    number, unit = split
    mult = _TIME_UNITS.get(unit.lower())
    if mult is None:
        raise ValueError(f"unknown time unit {unit!r} in {_fmt_value(value)}; expected one of s, ms, us, µs, ns")
    return _check(_to_float(number * mult, value, "time"), value, "time", positive)


def parse_flops(value: object, *, positive: bool = True) -> float:
    """Parse a compute rate such as ``"15.7 TFLOP/s"`` or ``"312 TFLOPS"`` to FLOP/s."""
    split = _split(value, "compute rate")
    if isinstance(split, float):
        return _check(split, value, "compute rate", positive)
    number, unit = split
    match = _FLOPS_RE.match(unit)
    if match is None:
        raise ValueError(
            f"unknown compute unit {unit!r} in {_fmt_value(value)}; expected e.g. FLOP/s, GFLOP/s, "
            "TFLOP/s, TFLOPS"
        )
    rate = _to_float(number * _DECIMAL[match.group("prefix").lower()], value, "compute rate")
    return _check(rate, value, "compute rate", positive)


# ----------------------------------------------------------------------------------------- formatting


def _exact_text(value: float, name: str, mult: Fraction, parse) -> str | None:
    scaled = float(Fraction(value) / mult)
    for spec in (".12g", ".17g"):  # readable first; 17 significant digits always round-trip a double
        text = f"{format(scaled, spec)} {name}"
        if parse(text) == value:
            return text
    return None


def _format(
    value: float,
    groups: list[list[tuple[str, Fraction]]],
    parse,
    digits: int | None,
    base_name: str,
    exact_int: bool = False,
) -> str:
    """Format ``value`` with, per unit group (e.g. decimal vs binary prefixes), the largest unit not
    exceeding it; the shortest text over groups wins (ties: first group). Without ``digits`` the
    result parses back to exactly ``value`` (more digits, or the base unit, when needed); with
    ``digits`` it is rounded to that many significant digits (for display). ``base_name`` is the
    unit of multiplier 1 (used for zero and as the exact fallback)."""
    if value == 0:
        return f"0 {base_name}"
    texts = []
    for group in groups:
        fitting = [unit for unit in group if abs(value) >= unit[1]] or [group[0]]
        name, mult = max(fitting, key=lambda u: u[1])
        if digits is not None:
            texts.append(f"{float(Fraction(value) / mult):.{digits}g} {name}")
            continue
        text = _exact_text(value, name, mult, parse)
        if text is not None:
            texts.append(text)
    if not texts:
        return f"{int(value) if exact_int else repr(float(value))} {base_name}"
    return min(texts, key=len)


def _prefixed(base: str, prefixes: dict[str, int], scale: Fraction) -> list[tuple[str, Fraction]]:
    """Units for ``base`` with each prefix, ascending ('k' is written 'K', 'ki' as 'Ki')."""
    names = {p: p[:1].upper() + p[1:] for p in prefixes}
    return sorted(((names[p] + base, scale * m) for p, m in prefixes.items()), key=lambda u: u[1])


def format_bytes(value: int, *, digits: int | None = None) -> str:
    """Format a byte count, e.g. ``16000000000 -> "16 GB"``, ``17179869184 -> "16 GiB"``.

    Exact (parses back to ``value``, the shorter of decimal and binary prefixes: for files) unless
    ``digits`` asks for rounding to significant digits: for display, always binary prefixes with
    IEC names (``"14.9 GiB"``, ``"603 KiB"``), so that every size TAG prints is in one unit
    system."""
    groups = [_prefixed("B", _BINARY, Fraction(1))] if digits is not None else \
        [_prefixed("B", _DECIMAL, Fraction(1)), _prefixed("B", _BINARY, Fraction(1))]
    return _format(int(value), groups, lambda t: parse_bytes(t, positive=False), digits, "B", exact_int=True)


def format_bandwidth(value: float, *, bits: bool = False, digits: int | None = None) -> str:
    """Format bytes/s, e.g. ``1.5e11 -> "150 GB/s"``; ``bits=True`` gives ``"25 Gbit/s"``.

    Exact (parses back to ``value``) unless ``digits`` asks for rounding to significant digits: for
    display, always decimal prefixes (rates are quoted in powers of 1000: links, HBM)."""
    if bits:
        groups = [_prefixed("bit/s", _DECIMAL, Fraction(1, 8))]
    elif digits is not None:
        groups = [_prefixed("B/s", _DECIMAL, Fraction(1))]
    else:
        groups = [_prefixed("B/s", _DECIMAL, Fraction(1)), _prefixed("B/s", _BINARY, Fraction(1))]
    return _format(float(value), groups, lambda t: parse_bandwidth(t, positive=False), digits, "B/s")


def format_time(value: float, *, digits: int | None = None) -> str:
    """Format seconds, e.g. ``2e-05 -> "20 us"`` (exact unless ``digits`` is given)."""
    group = [("ns", Fraction(1, 10**9)), ("us", Fraction(1, 10**6)), ("ms", Fraction(1, 10**3)), ("s", Fraction(1))]
    return _format(float(value), [group], lambda t: parse_time(t, positive=False), digits, "s")


def format_flops(value: float, *, digits: int | None = None) -> str:
    """Format FLOP/s, e.g. ``1.57e13 -> "15.7 TFLOP/s"`` (exact unless ``digits`` is given)."""
    groups = [_prefixed("FLOP/s", _DECIMAL, Fraction(1))]
    return _format(float(value), groups, lambda t: parse_flops(t, positive=False), digits, "FLOP/s")


def format_count(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 machine"``, ``"7 machines"``: a count with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
