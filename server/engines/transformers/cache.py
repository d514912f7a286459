"""One full-attention layer of the transformers engine's batch cache, changed in place.

Theory of operation
-------------------
transformers' ``DynamicLayer`` keeps a layer's keys and values as ``[rows, heads, length,
dim]`` tensors and appends a step's column by concatenation: a copy of every row's whole
cache, every step, into a fresh tensor (whose pages the kernel then faults in). A batch
whose rows come and go copied it all again at each join and each leave. On the tiny model
of the tests, 64 rows of 1,000 tokens, that was most of a step (docs/changelog.md, 2026-12-02,
"Isolation: The transformers engine's step"; the step's current cost: docs/benchmarks.md,
"The transformers engine's step").

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
* before ``end`` reaches the buffer's last column, the live region *migrates* to new
  buffers (:class:`_Migration`), a chunk of columns per step. It starts when the columns
  left past ``end`` fall below half the room (below). The new buffers have twice the room
  (at least 4 rows and 32 columns, or an eighth more). Each step copies enough columns of
  every row to catch up with ``end`` in about a quarter of the room's steps. Rows that move
  or join meanwhile are copied into the new buffers too (only the columns copied so far),
  and the step that catches up switches the views over. So growth, and the slide of a
  batch whose oldest rows leave, cost O(1) copying per token *and per step*. One move of
  the whole cache in one step held every stream of the batch for as long as that copy
  (100-280 ms at 64 rows of 600-1,100 tokens on one core; docs/transformers.md,
  "Continuous batching");
* a join that needs more rows than the buffers hold, or columns on the left that they
  have not, moves the live region at once into new buffers with room to spare. A
  migration under way finishes first when its buffers have the rows. A join longer than
  the batch, or with more rows than the migration's buffers hold, drops the migration,
  and the next step starts another.

Padding must be finite (zeros): the attention mask keeps it out of the softmax, but a NaN
there would still poison the weighted sum. Memory freed by a leaving row is reused by the
next joining one; the buffers go when the batch empties (``KVBatch.clear``) or move. While
a migration runs, both the old and the new buffers are held (as a move held both, for
that one copy).

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


class _Migration:
    """New buffers being filled: old column ``c`` is new column ``c - base``; old columns
    ``[base, base + done)`` of every row are copied; ``chunk`` columns more per step."""

    __slots__ = ("kbuf", "vbuf", "base", "done", "chunk")

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, base: int, chunk: int) -> None:
        self.kbuf, self.vbuf, self.base, self.done, self.chunk = kbuf, vbuf, base, 0, chunk


class RoomyLayer(DynamicLayer):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._rows = self._start = self._end = 0
        self._next: _Migration | None = None
        #: Columns copied, summed over rows and both buffers (see :meth:`statistics`).
        self._copied = 0

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
        self._next = None  # (its buffers go before new ones are made)
        n, heads, length, dim = keys.shape
        width = left + length
        total_rows = n + rows + _room(n + rows, _ROOM_MIN_ROWS)
        total_columns = width + columns + _room(width + columns, _ROOM_MIN_COLUMNS)
        kbuf = keys.new_empty((total_rows, heads, total_columns, dim))
        vbuf = values.new_empty((total_rows, heads, total_columns, values.shape[3]))
        for buf, t in ((kbuf, keys), (vbuf, values)):
            buf[:n, :, :left].zero_()
            buf[:n, :, left:width] = t
        self._copied += 2 * n * length
        self._kbuf, self._vbuf = kbuf, vbuf
        self._hold(n, 0, width)

    def _adopt(self) -> None:
        """Views that someone else assigned go into buffers of this layer's own first."""
        if not self._own():
            self._move(self.keys, self.values, rows=0, columns=0)

    def _room_for(self, rows: int, columns: int) -> None:
        """Make room for ``rows`` more rows and ``columns`` more columns past ``end``: at
        once (a join, or a migration that has not caught up in time)."""
        if not self._own():
            self._move(self.keys, self.values, rows=rows, columns=columns)
            return
        if self._rows + rows <= self._kbuf.shape[0] and self._end + columns <= self._kbuf.shape[2]:
            return
        nxt = self._next
        if nxt is not None and self._rows + rows <= nxt.kbuf.shape[0]:
            self._migrate(self._end)  # the rest, now: its buffers have the rows
            if self._end + columns <= self._kbuf.shape[2]:
                return
        self._move(self.keys, self.values, rows=rows, columns=columns)

    # -- migration -------------------------------------------------------------------------

    def _migrate(self, columns: int) -> None:
        """Start a migration when the columns left run low; copy up to ``columns`` more
        columns of the one running; switch the views over once it has caught up."""
        if not self._own():  # someone else's views: they move at once (_adopt)
            self._next = None
            return
        nxt = self._next
        if nxt is None:
            length = self._end - self._start
            room = _room(length, _ROOM_MIN_COLUMNS)
            if self._kbuf.shape[2] - self._end >= room // 2:
                return
            total_rows = max(self._kbuf.shape[0], self._rows + _room(self._rows, _ROOM_MIN_ROWS))
            shape = (total_rows, self._kbuf.shape[1], length + 2 * room)
            kbuf = self._kbuf.new_empty((*shape, self._kbuf.shape[3]))
            vbuf = self._vbuf.new_empty((*shape, self._vbuf.shape[3]))
            # Caught up within a quarter of the room's steps (the end gains one a step).
            chunk = 2 + -(-4 * length // room)
            self._next = nxt = _Migration(kbuf, vbuf, self._start, chunk)
            columns = chunk
        rows, base, done = self._rows, nxt.base, nxt.done
        if base + done < self._start:  # columns dropped since: no need to copy them
            nxt.done = done = self._start - base
        todo = min(columns, self._end - base - done)
        if todo > 0:
            a, b = base + done, base + done + todo
            nxt.kbuf[:rows, :, done : done + todo] = self._kbuf[:rows, :, a:b]
            nxt.vbuf[:rows, :, done : done + todo] = self._vbuf[:rows, :, a:b]
            nxt.done = done = done + todo
            self._copied += 2 * rows * todo
        if base + done == self._end:  # caught up: the new buffers hold every live column
            self._kbuf, self._vbuf, self._next = nxt.kbuf, nxt.vbuf, None
            self._hold(rows, self._start - base, self._end - base)

    # -- what KVBatch and the model call --------------------------------------------------

    def update(self, key_states, value_states, *args, **kwargs):
        """A forward pass's new columns (transformers calls this): written in place."""
        if not self.is_initialized:  # (KVBatch makes its layers with `taking`)
            self.lazy_initialization(key_states, value_states)
            self._move(key_states, value_states, rows=0, columns=0)
            return self.keys, self.values
        n = key_states.shape[-2]
        nxt = self._next
        self._migrate(nxt.chunk if nxt is not None else 0)
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
            self._copied += 2 * into.numel() * (e - s)
            nxt = self._next
            if nxt is not None and nxt.done > s - nxt.base:  # the columns it has copied
                c, d = s - nxt.base, nxt.done  # (of the view: left of it nothing is read)
                nxt.kbuf[into, :, c:d] = nxt.kbuf[from_, :, c:d]
                nxt.vbuf[into, :, c:d] = nxt.vbuf[from_, :, c:d]
                self._copied += 2 * into.numel() * (d - c)
        self._hold(rows, s, e)

    def drop_columns(self, n: int) -> None:
        """The first ``n`` columns are padding in every row: they leave the view."""
        self._adopt()
        self._hold(self._rows, self._start + n, self._end)

    def join(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New rows, right-aligned with the others (the shorter side padded on the left)."""
        k, new = keys.shape[0], keys.shape[2]
        more = new - self.keys.shape[2]  # the others need this much padding on the left
        nxt = self._next
        if nxt is not None and (more > 0 or self._rows + k > nxt.kbuf.shape[0]):
            self._next = nxt = None  # (rare: the next migration starts afresh)
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
        self._copied += 2 * k * new
        nxt = self._next
        if nxt is not None and nxt.done > s - nxt.base:  # the new rows' columns it has
            a, c, d = nxt.base, s - nxt.base, nxt.done  # copied for the others (of the view)
            nxt.kbuf[rows : rows + k, :, c:d] = self._kbuf[rows : rows + k, :, a + c : a + d]
            nxt.vbuf[rows : rows + k, :, c:d] = self._vbuf[rows : rows + k, :, a + c : a + d]
            self._copied += 2 * k * (d - c)
        self._hold(rows + k, s, e)

    def reset(self) -> None:
        self._kbuf = self._vbuf = self._next = None
        self._rows = self._start = self._end = 0
        super().reset()

    def statistics(self) -> dict:
        """``copied``: columns copied so far (a row's column of keys or of values counts
        one), by steps, joins, leaves and moves; ``migrating``: whether new buffers are
        being filled."""
        return {"copied": self._copied, "migrating": self._next is not None}

