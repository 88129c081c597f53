"""Preference pairs as the engine reads them: one window per half of a pair, the two halves of a
pair side by side in every micro-batch.

Tokenised, pair i is documents 2i (prompt + chosen) and 2i + 1 (prompt + rejected). Each half
is a window of its own (padded, never packed with another document). A batch of pairs
[i, j, ...] holds the rows [chosen i, rejected i, chosen j, rejected j, ...] and `pair_index`
(one entry per pair: its index among all pairs, training pairs first, then held-out ones; -1 for
padding): interleaved, so batches joined along the rows stay pairs, and the precomputed
reference log-probs are looked up by example, whatever the micro-batch, the rung or the resume.
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.data.documents import Documents

PAIR_INDEX = "pair_index"


class PairWindows:
    """Pairs addressed by index; `batch` gives the interleaved rows of the pairs asked for."""

    def __init__(self, windows, first_index: int = 0):
        if len(windows) % 2:
            raise ValueError("preference windows come in pairs")
        self.windows = windows
        self.first_index = first_index  # the index of this set's first pair among all pairs

    def __len__(self) -> int:
        return len(self.windows) // 2

    def batch(self, indices: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64)
        rows = np.stack([2 * idx, 2 * idx + 1], axis=1).reshape(-1)
        out = self.windows.batch(rows)
        out[PAIR_INDEX] = torch.from_numpy(idx + self.first_index)
        return out


def pair_subset(docs: Documents, pairs: np.ndarray) -> Documents:
    """The documents of the given pairs (both halves of each), in order."""
    return docs.subset(np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1))
