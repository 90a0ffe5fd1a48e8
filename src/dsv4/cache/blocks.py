"""A fixed set of physical blocks handed out from a free list, reference-counted so that forked
sequences can share the full blocks of a common prefix."""

from __future__ import annotations


class CacheCapacityError(RuntimeError):
    """A pool has too few free blocks (or sequence slots) for a call; nothing was written."""


class BlockAllocator:
    """``num_blocks`` blocks, ids 0 .. num_blocks - 1. A block is free while its count is 0."""

    def __init__(self, num_blocks: int, what: str) -> None:
        if num_blocks <= 0:
            raise ValueError(f"{what}: a pool needs at least one block, got {num_blocks}")
        self.what = what
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        # lowest ids first, so a fresh pool fills its storage front to back
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with count 1; raises before taking any if fewer are free."""
        if n > len(self._free):
            raise CacheCapacityError(
                f"{self.what}: {n} more block(s) needed but only {len(self._free)} of "
                f"{self.num_blocks} are free (free finished sequences or make a larger pool)")
        taken = [self._free.pop() for _ in range(n)]
        for b in taken:
            self._refs[b] = 1
        return taken

    def share(self, block: int) -> None:
        """One more holder of an allocated block (a fork's shared prefix)."""
        if self._refs[block] <= 0:
            raise RuntimeError(f"{self.what}: block {block} is not allocated")
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop one holder; the block returns to the free list when none is left."""
        if self._refs[block] <= 0:
            raise RuntimeError(f"{self.what}: block {block} released more often than held")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]
