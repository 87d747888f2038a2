"""Acceptance of chain drafts: per-position rates -> expected tokens per verify.

Two conventions for "per-position acceptance" exist; both are accepted here:

- *conditional* rates `c_i = P(draft i accepted | drafts 1..i-1 accepted)`;
- *marginal* rates `m_i = P(drafts 1..i all accepted)` (what vLLM and NeMo RL log as
  `num_accepted_tokens_per_pos / num_drafts`), non-increasing, `m_i = c_1 ... c_i`.

The expected acceptance length (tokens emitted per target forward, bonus/correction
token included) of a chain of k drafts is `1 + m_1 + ... + m_k`; with a constant rate a
it is the closed form (1 - a^{k+1}) / (1 - a).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["Acceptance"]


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Conditional acceptance rate of each draft position (1-based position i = index i-1).

    Positions past the end of `rates` reuse the last rate.
    """

    rates: tuple[float, ...]

    def __post_init__(self):
        if not self.rates:
            raise ValueError("Acceptance needs at least one rate")
        for r in self.rates:
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"acceptance rates must lie in [0, 1], got {self.rates}")

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def constant(cls, rate: float) -> "Acceptance":
        """The same conditional rate at every position (the i.i.d. textbook model)."""
        return cls((float(rate),))

    @classmethod
    def decaying(cls, first: float, decay: float, positions: int = 16) -> "Acceptance":
        """c_i = first * decay^(i-1): later draft positions are harder (EAGLE-style drafts)."""
        return cls(tuple(min(1.0, first * decay**i) for i in range(positions)))

    @classmethod
    def from_marginal(cls, marginal: Sequence[float]) -> "Acceptance":
        """From m_i = P(first i drafts accepted) (vLLM's per-position rates)."""
        m = [float(x) for x in marginal]
        prev = 1.0
        rates = []
        for i, x in enumerate(m):
            if x > prev + 1e-9 or x < 0:
                raise ValueError(
                    f"marginal per-position acceptance must be non-increasing in [0, 1]; "
                    f"position {i + 1} has {x} after {prev} (got {m})"
                )
            rates.append(0.0 if prev == 0 else min(1.0, x / prev))
            prev = x
        return cls(tuple(rates))

    @classmethod
    def from_length(cls, length: float, k: int) -> "Acceptance":
        """The constant rate a whose chain of k drafts has expected length `length`:
        (1 - a^{k+1}) / (1 - a) = length, solved by bisection."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not 1.0 <= length <= k + 1:
            raise ValueError(f"acceptance length must lie in [1, k+1] = [1, {k + 1}], got {length}")
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if cls.constant(mid).length(k) < length:
                lo = mid
            else:
                hi = mid
        return cls.constant(0.5 * (lo + hi))

    # ---- queries --------------------------------------------------------------------------
    def rate(self, position: int) -> float:
        """Conditional rate at 1-based `position`."""
        return self.rates[min(position, len(self.rates)) - 1]

    def marginal(self, k: int) -> list[float]:
        """[m_1 .. m_k]: probability that the first i drafts are all accepted."""
        out, prod = [], 1.0
        for i in range(1, k + 1):
            prod *= self.rate(i)
            out.append(prod)
        return out

    def length(self, k: int) -> float:
        """Expected tokens emitted per verify with a chain of k drafts (k = 0: plain decode)."""
        return 1.0 + math.fsum(self.marginal(k))
