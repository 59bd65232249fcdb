"""The sequencer's arithmetic: which lane serves which global slot, and which slots a rank gets.

Global slot `i` is served by lane `i mod L` as that lane's sample `i div L`. Step `b` is slots
`[b*G, (b+1)*G)`. DP rank `r` of `R` takes the slots of each step with `i mod R == r`, in slot
order; since `R` divides `L`, those come only from lanes `l mod R == r`, so no rank ever needs
another rank's lanes.
"""

from __future__ import annotations

import math

from zephon_stream.errors import ConfigError

__all__ = ["check_world", "consumed", "rank_lanes", "rank_slots"]


def check_world(lanes: int, global_batch: int, dp_size: int, dp_rank: int) -> None:
    """Refuse a world size that cannot keep the order identical to a single-rank run."""
    if dp_size < 1:
        raise ConfigError(f"dp_size={dp_size}: give the number of data-parallel ranks, >= 1")
    if not 0 <= dp_rank < dp_size:
        unset = "; dp_size is 1 unless given" if dp_size == 1 else ""
        raise ConfigError(f"dp_rank={dp_rank} dp_size={dp_size}: need 0 <= dp_rank < dp_size (dp_rank is this "
                          f"rank's index among the dp_size ranks{unset})")
    if lanes % dp_size or global_batch % dp_size:  # the sizes that keep the order divide both
        ok = [d for d in range(1, math.gcd(lanes, global_batch) + 1) if lanes % d == 0 and global_batch % d == 0]
        what, n = ("lanes", lanes) if lanes % dp_size else ("global_batch_size", global_batch)
        raise ConfigError(f"dp_size={dp_size} does not divide {what}={n}: use a dp_size in {ok} (they divide "
                          f"lanes={lanes} and global_batch_size={global_batch}), or set {what} to a multiple of "
                          f"{dp_size} (which changes the order)")


def rank_lanes(lanes: int, dp_size: int, dp_rank: int) -> list[int]:
    return [lane for lane in range(lanes) if lane % dp_size == dp_rank]


def rank_slots(step: int, global_batch: int, dp_size: int, dp_rank: int) -> range:
    first = step * global_batch
    return range(first + dp_rank, first + global_batch, dp_size)


def consumed(lane: int, lanes: int, slots: int) -> int:
    """Samples lane `lane` has served once the first `slots` global slots are consumed."""
    return max(0, (slots - lane + lanes - 1) // lanes)
