"""One full-attention layer of the transformers engine's batch cache, changed in place.

Theory of operation
-------------------
transformers' ``DynamicLayer`` keeps a layer's keys and values as ``[rows, heads, length,
dim]`` tensors and appends a step's column by concatenation: a copy of every row's whole
cache, every step, into a fresh tensor (whose pages the kernel then faults in). A batch
whose rows come and go copied it all again at each join and each leave. On the tiny model
of the tests, 64 rows of 1,000 tokens, that was most of a step (docs/benchmarks.md, "The
transformers engine's step").

:class:`RoomyLayer` holds each tensor as a *view* of a larger buffer: rows ``[0, rows)``,
columns ``[start, end)``. transformers' code sees only the view (``keys``, ``values``), of
the shape it expects. So:

* a decode step writes its column at ``end`` (:meth:`RoomyLayer.update`);
* a row that leaves has the last row moved into its place (:meth:`move_rows`: a copy of one
  row, not of the batch; the batch's row order changes, and ``KVBatch.remove`` returns the
  new one), and padding columns that no row uses any more are dropped by moving
  ``start`` (:meth:`drop_columns`: no copy);
* joining rows are written into spare rows, right-aligned at ``end``, their left padding
  zeroed (:meth:`join`), when the buffer has the rows and the columns for them;
* when it has not, or ``end`` reaches the buffer's last column, the live region moves: to
  column 0 of the same buffer, a block at a time (no block overlaps its source), when that
  leaves room; else into a new buffer with room to spare (an eighth more rows and columns,
  at least 4 rows and 32 columns), so growth costs O(1) copying per token.

Padding must be finite (zeros): the attention mask keeps it out of the softmax, but a NaN
there would still poison the weighted sum. Memory freed by a leaving row is reused by the
next joining one; the buffers go when the batch empties (``KVBatch.clear``) or move.

Whoever assigns ``keys``/``values`` other than through these methods (transformers' own
``crop``, ``reorder_cache`` ...) leaves views of other storage: :meth:`update` moves them
into new buffers first, so such paths stay correct, only slower.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["RoomyLayer"]

_ROOM_SHARE = 8  # spare rows and columns: an eighth more ...
_ROOM_MIN_COLUMNS = 32  # ... at least these
_ROOM_MIN_ROWS = 4


def _room(n: int, least: int) -> int:
    return max(least, n // _ROOM_SHARE)


class RoomyLayer(DynamicLayer):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._rows = self._start = self._end = 0

    @classmethod
    def taking(cls, layer: DynamicLayer) -> "RoomyLayer":
        """A roomy layer holding ``layer``'s keys and values (copied into new buffers)."""
        new = cls()
        new.is_initialized = True  # (dtype and device: not kept by every transformers 5)
        new.dtype, new.device = layer.keys.dtype, layer.keys.device
        new._move(layer.keys, layer.values, rows=0, columns=0)
        return new

    # -- views ---------------------------------------------------------------------------

    def _hold(self, rows: int, start: int, end: int) -> None:
        self._rows, self._start, self._end = rows, start, end
        self.keys = self._kbuf[:rows, :, start:end]
        self.values = self._vbuf[:rows, :, start:end]

    def _own(self) -> bool:
        """Whether ``keys`` is still the view this layer made (nobody assigned another)."""
        kbuf = self._kbuf
        return (
            kbuf is not None
            and self.keys.shape[0] == self._rows
            and self.keys.shape[2] == self._end - self._start
            and self.keys.data_ptr() == kbuf[0, 0, self._start].data_ptr()
        )

    def _move(self, keys: torch.Tensor, values: torch.Tensor, *, rows: int, columns: int,
              left: int = 0) -> None:
        """Into new buffers, ``left`` zero columns before the live ones, with room for
        ``rows`` more rows and ``columns`` more columns, and some to spare."""
        n, heads, length, dim = keys.shape
        width = left + length
        total_rows = n + rows + _room(n + rows, _ROOM_MIN_ROWS)
        total_columns = width + columns + _room(width + columns, _ROOM_MIN_COLUMNS)
        kbuf = keys.new_empty((total_rows, heads, total_columns, dim))
        vbuf = values.new_empty((total_rows, heads, total_columns, values.shape[3]))
        for buf, t in ((kbuf, keys), (vbuf, values)):
            buf[:n, :, :left].zero_()
            buf[:n, :, left:width] = t
        self._kbuf, self._vbuf = kbuf, vbuf
        self._hold(n, 0, width)

    def _adopt(self) -> None:
        """Views that someone else assigned go into buffers of this layer's own first."""
        if not self._own():
            self._move(self.keys, self.values, rows=0, columns=0)

    def _room_for(self, rows: int, columns: int) -> None:
        """Make room for ``rows`` more rows and ``columns`` more columns past ``end``."""
        if self._own() and self._rows + rows <= self._kbuf.shape[0]:
            if self._end + columns <= self._kbuf.shape[2]:
                return
            length = self._end - self._start
            if self._kbuf.shape[2] - length - columns >= _room(length, _ROOM_MIN_COLUMNS) // 2:
                self._shift_to_front()
                return
        self._move(self.keys, self.values, rows=rows, columns=columns)

    def _shift_to_front(self) -> None:
        """Move the live columns to column 0 of the same buffers, a block at a time."""
        start, length, rows = self._start, self._end - self._start, self._rows
        block = start  # a block never overlaps its source: the source is `start` further on
        for buf in (self._kbuf, self._vbuf):
            for c in range(0, length, block):
                c1 = min(c + block, length)
                buf[:rows, :, c:c1] = buf[:rows, :, start + c : start + c1]
        self._hold(rows, 0, length)

    # -- what KVBatch and the model call --------------------------------------------------

    def update(self, key_states, value_states, *args, **kwargs):
        """A forward pass's new columns (transformers calls this): written in place."""
        if not self.is_initialized:  # (KVBatch makes its layers with `taking`)
            self.lazy_initialization(key_states, value_states)
            self._move(key_states, value_states, rows=0, columns=0)
            return self.keys, self.values
        n = key_states.shape[-2]
        self._room_for(0, n)
        end = self._end
        self._kbuf[: self._rows, :, end : end + n] = key_states
        self._vbuf[: self._rows, :, end : end + n] = value_states
        self._hold(self._rows, self._start, end + n)
        return self.keys, self.values

    def move_rows(self, into: torch.Tensor, from_: torch.Tensor, rows: int) -> None:
        """Row ``from_[i]`` goes to row ``into[i]``; then only the first ``rows`` are kept."""
        self._adopt()
        s, e = self._start, self._end
        if into.numel():
            self._kbuf[into, :, s:e] = self._kbuf[from_, :, s:e]
            self._vbuf[into, :, s:e] = self._vbuf[from_, :, s:e]
        self._hold(rows, s, e)

    def drop_columns(self, n: int) -> None:
        """The first ``n`` columns are padding in every row: they leave the view."""
        self._adopt()
        self._hold(self._rows, self._start + n, self._end)

    def join(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New rows, right-aligned with the others (the shorter side padded on the left)."""
        k, new = keys.shape[0], keys.shape[2]
        more = new - self.keys.shape[2]  # the others need this much padding on the left
        if more > 0:
            if self._own() and self._start >= more and self._rows + k <= self._kbuf.shape[0]:
                s = self._start
                for buf in (self._kbuf, self._vbuf):
                    buf[: self._rows, :, s - more : s].zero_()
                self._hold(self._rows, s - more, self._end)
            else:
                self._move(self.keys, self.values, rows=k, columns=0, left=more)
        self._room_for(k, 0)
        rows, s, e = self._rows, self._start, self._end
        for buf, t in ((self._kbuf, keys), (self._vbuf, values)):
            buf[rows : rows + k, :, s : e - new].zero_()
            buf[rows : rows + k, :, e - new : e] = t
        self._hold(rows + k, s, e)

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._rows = self._start = self._end = 0
        super().reset()

