"""The running batch of the transformers engine: one padded KV cache, rows that come and go.

Example::

    batch = KVBatch(model)
    logits = batch.prefill([[5, 6, 7], [8, 9]])   # new rows join; logits of their last tokens
    logits = batch.decode([11, 12, 13])           # one token for every row, in row order
    order = batch.remove([0])                     # row 0 leaves, row 1 takes its place: [1]

Theory of operation
-------------------
Every running request is one row of a single :class:`~transformers.DynamicCache` whose
tensors are ``[rows, heads, length, head_dim]``. Rows are *left*-padded so that their last
tokens line up: the next decode step appends one column for every row. A 2-D attention mask
(1 = real token) tells the model which columns are padding, and each row's ``position_ids``
count only its real tokens, so a padded row computes what it would compute alone (up to
floating-point rounding, which differs between batch shapes).

* **Join** (:meth:`prefill`): the new prompts run as one left-padded forward pass with a
  cache of their own, which is then merged in: whichever side is shorter is padded on the
  left to the longer one, and the rows are concatenated.
* **Decode** (:meth:`decode`): one forward pass of one token per row.
* **Leave** (:meth:`remove`): the last rows move into the places of those that leave (so
  the row order changes: :meth:`remove` returns the new one), and the leading columns that
  are padding in every remaining row are cut off, so the batch is never longer than its
  longest remaining row.

Full-attention layers are kept as :class:`~server.engines.transformers.cache.RoomyLayer`: views of
larger buffers, so that a step writes one column, a leaving row costs the copy of one row, and a
joining one the copy of its own cache, where transformers' own layer copied the whole
cache at each of these (see that module). Sliding-window layers keep transformers' own
update (they track their length themselves) and are copied as before.

The cost of padding is attention over padding columns; the model weights are read once per
step for the whole batch, which is what makes a batch faster than its rows one by one.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .cache import RoomyLayer

__all__ = ["KVBatch", "UnsupportedModel", "sliding_window"]

_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


class UnsupportedModel(Exception):
    """The model's cache is not a plain per-layer key/value cache this batch can merge."""


def sliding_window(model) -> int | None:
    """The smallest sliding window of the model's cache layers (None: none slide).

    A sliding layer is served as a full one, which is exact while no sequence is longer than
    the window: the engine caps its context there. Other layer kinds (linear attention,
    quantized caches) raise :class:`UnsupportedModel`.
    """
    windows = []
    for layer in DynamicCache(config=model.config).layers:
        if type(layer) is DynamicSlidingWindowLayer:
            windows.append(layer.sliding_window)
        elif type(layer) is not DynamicLayer:
            raise UnsupportedModel(
                f"the transformers engine cannot batch this model's {type(layer).__name__} "
                "cache layers (only full and sliding-window attention are supported)"
            )
    return min(windows) if windows else None


class KVBatch:
    """See the module docstring. Rows are numbered 0..size-1; joining rows come last."""

    def __init__(self, model) -> None:
        self.model = model
        self.device = model.device
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, length] int64, 1 = real token
        self.positions: torch.Tensor | None = None  # [rows] position of each row's next token

    @property
    def size(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    @property
    def length(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def cached_tokens(self) -> int:
        """Key/value slots held, padding included (rows * length)."""
        return self.size * self.length

    def _forward(self, input_ids, mask, positions, cache):
        kwargs = {self._cache_kw: cache, **self._extra}
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1, :]

    # -- rows join ---------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Run the prompts as new rows (appended in order); returns their next-token logits."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids = ids.to(self.device)
        mask = mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        self._merge(cache, mask, lengths)
        return logits

    def _layers(self, cache: DynamicCache) -> list:
        layers = getattr(cache, "layers", None)
        if not layers or any(
            type(layer) not in _LAYERS or getattr(layer, "keys", None) is None for layer in layers
        ):
            raise UnsupportedModel("the model made a cache the transformers engine cannot batch")
        return layers

    def _lengths_changed(self) -> None:
        """Tell sliding layers their new length (they compute their masks from it)."""
        for layer in self.cache.layers:
            if type(layer) is DynamicSlidingWindowLayer:
                layer.cumulative_length = layer.keys.shape[-2]

    def _merge(self, cache: DynamicCache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        layers = self._layers(cache)
        if self.cache is None:
            cache.layers = [
                RoomyLayer.taking(layer) if type(layer) is DynamicLayer else layer
                for layer in layers
            ]
            self.cache, self.mask, self.positions = cache, mask, lengths
            return
        old_len, new_len = self.length, mask.shape[1]
        width = max(old_len, new_len)
        for dst, src in zip(self.cache.layers, layers):
            if type(dst) is RoomyLayer:
                dst.join(src.keys, src.values)
                continue
            dst.keys = torch.cat(
                [_pad_left(dst.keys, width - old_len), _pad_left(src.keys, width - new_len)]
            )
            dst.values = torch.cat(
                [_pad_left(dst.values, width - old_len), _pad_left(src.values, width - new_len)]
            )
        self.mask = torch.cat(
            [F.pad(self.mask, (width - old_len, 0)), F.pad(mask, (width - new_len, 0))]
        )
        self.positions = torch.cat([self.positions, lengths])
        self._lengths_changed()

    # -- a step ------------------------------------------------------------------------------

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One token per row (row order); returns the next-token logits, ``[rows, vocab]``."""
        ids = torch.tensor(tokens, dtype=torch.long).to(self.device)[:, None]
        self.mask = F.pad(self.mask, (0, 1), value=1)
        logits = self._forward(ids, self.mask, self.positions[:, None], self.cache)
        self.positions = self.positions + 1
        return logits

    # -- rows leave --------------------------------------------------------------------------

    def remove(self, rows: list[int]) -> list[int]:
        """Drop these rows (their slots are free now); returns the new row order: row ``i``
        is the former row ``order[i]`` (the last rows move into the places left)."""
        size = self.size
        gone = set(rows)
        if not gone:
            return list(range(size))
        kept = size - len(gone)
        if kept <= 0:
            self.clear()
            return []
        holes = [i for i in range(kept) if i in gone]
        fillers = [i for i in range(kept, size) if i not in gone]
        order = list(range(kept))
        for hole, filler in zip(holes, fillers):
            order[hole] = filler
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        mask = self.mask.index_select(0, index)
        used = mask.any(0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        into = torch.tensor(holes, dtype=torch.long, device=self.device)
        from_ = torch.tensor(fillers, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:  # the layers first, then the mask and positions
            if type(layer) is RoomyLayer:
                layer.move_rows(into, from_, kept)
                layer.drop_columns(start)
                continue
            layer.keys = layer.keys.index_select(0, index)[:, :, start:].contiguous()
            layer.values = layer.values.index_select(0, index)[:, :, start:].contiguous()
        self.mask = mask[:, start:].contiguous()
        self.positions = self.positions.index_select(0, index)
        self._lengths_changed()
        return order

    def clear(self) -> None:
        """Drop every row and free the whole cache."""
        self.cache = None
        self.mask = None
        self.positions = None


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """Pad the sequence axis (-2) of a ``[rows, heads, length, dim]`` tensor on the left."""
    return F.pad(t, (0, 0, n, 0)) if n else t
