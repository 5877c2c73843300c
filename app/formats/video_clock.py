"""A video stream's clock: its timestamps and its frame numbers, one mapped to the other in exact arithmetic.

A clip asks for frames by number (frame ``n`` of a stream at ``rate`` frames a second is the one shown at ``n /
rate`` seconds after its first), and a decoder hands out frames by timestamp, in units of the stream's time base.
The two meet only approximately: WebM keeps milliseconds (frame 2 of 30 fps is stamped 67 ms, past 2 / 30 s;
frame 1 of 60 fps 17 ms), 29.97 fps is 30000/1001, and a float floored from either picks the frame before. So a
timestamp is mapped to the *nearest* frame number with integers only: ``round((pts - origin) * time_base *
rate)``, the time base and the rate as the fractions the container declares. A stream at a constant rate maps
each of its frames to its own number; a variable rate maps several frames to one number, or none to another
(the clip takes the last frame before a number no frame has).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class FrameClock:
    """The exact map between a stream's timestamps (``time_base`` units from ``origin``) and frame numbers."""

    time_base: Fraction  # seconds a timestamp unit
    rate: Fraction  # frames a second (the stream's average rate)
    origin: int = 0  # the timestamp of frame 0 (the stream's start)

    def __post_init__(self) -> None:
        if self.time_base <= 0 or self.rate <= 0:
            raise ValueError(f"a clock needs a positive time base and rate, got {self.time_base} and {self.rate}")

    def number(self, pts: int) -> int:
        """The frame number nearest the timestamp ``pts`` (halves round up)."""
        # (pts - origin) * tb * rate, rounded: floor((2 * x * num + den) / (2 * den)) in integers
        num = (pts - self.origin) * self.time_base.numerator * self.rate.numerator
        den = self.time_base.denominator * self.rate.denominator
        return (2 * num + den) // (2 * den)

    def pts(self, number: int) -> int:
        """The latest timestamp that maps to frame ``number`` or before it: where to seek for that frame."""
        # the largest pts with (pts - origin) * tb * rate < number + 1/2
        num = (2 * number + 1) * self.time_base.denominator * self.rate.denominator
        den = 2 * self.time_base.numerator * self.rate.numerator
        return self.origin + (num - 1) // den

    def seconds(self, pts: int) -> float:
        """A timestamp as seconds from the stream's start."""
        return float((pts - self.origin) * self.time_base)
