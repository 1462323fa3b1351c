"""Cutting a batch into a pipeline's micro-batches, and the weight of each.

Every tensor of at least one dimension is cut along dim 0 into ``m`` parts, in equal parts when its size
divides by ``m``, else one sample apart (``torch.tensor_split``: the first ``N mod m`` parts hold one more).
A list of plain values (strings, bytes, numbers, ``None``, or lists or tuples of them) as long as the
batch's tensors is per-sample data, as ``default_collate`` makes of a string field, and is cut by the
same index ranges, so each micro-batch's labels or texts stay beside its rows; so is a list or tuple of
records (mappings, dataclasses, named tuples, or lists of them) as long as the tensors outside such
lists, a detection collate's per-image targets (``[{"boxes": (k_i, 4), "labels": (k_i,)}, ...]``, or
COCO's per-image lists of annotation dicts), whose insides (tensors of any number of rows, a box's
coordinates in a list) are then not cut. The batch itself is never taken for records (a list of
loaders' batches). A tuple of plain values goes whole into each micro-batch (a collate's constants,
such as ``(mean, std)``, whatever the batch size).
:func:`micro_weights` then makes the mean of the micro-batch means the batch's mean whatever the split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

_PLAIN = (str, bytes, int, float, complex, bool, type(None))


def split_batch(batch: Any, m: int) -> list[Any]:
    """``m`` micro-batches of ``batch``: every tensor split along dim 0, in equal parts when the size
    divides by ``m``, else in parts one sample apart (a ragged last batch; see :func:`micro_weights`).
    Containers keep their type: lists, tuples and named tuples, mappings (``dict`` and others, such as
    Hugging Face's ``BatchEncoding``, rebuilt from a dict), dataclasses (their init fields). A list of
    plain values as long as a tensor of the batch is cut by that tensor's index ranges (before,
    a collated string field went whole into every micro-batch, and a metric pairing it with a micro-batch's
    outputs paired other samples' labels, silently); 0-dim tensors and anything else go whole into every
    micro-batch (before, a ``BatchEncoding`` did too, tensors and all: each micro-batch computed the whole
    batch, and ``predict`` returned it ``m`` times).

    Refused first (:func:`_check_sizes`): a tensor too small to cut, and tensors of different leading
    sizes that ``m`` does not divide, whose micro-batches would hold other shares of each."""
    outside = frozenset(n for _, n in _rows(batch, skip=None, top=True))
    sizes = _check_sizes(_rows(batch, skip=outside, top=True), m)
    return _split(batch, m, samples=frozenset(sizes), records=outside, top=True)


def eval_micro_count(batch: Any, m: int) -> int:
    """How many micro-batches an evaluation (or prediction) batch is cut into: ``m``, or fewer for a batch
    of fewer samples (a ragged last batch, an evaluation at batch size 1): its sample count when all its
    tensors have it, else 1 (the batch whole). A forward-only pass runs any count, so nothing is refused
    that one process would evaluate; training keeps ``m`` (its schedules are built for it)."""
    outside = frozenset(n for _, n in _rows(batch, skip=None, top=True))
    sizes = {n for _, n in _rows(batch, skip=outside, top=True)}
    if not sizes or min(sizes) >= m:
        return m
    return max(1, min(sizes)) if len(sizes) == 1 else 1


def _records(value: Any, *, top: bool = False) -> bool:
    """A non-empty list or tuple of per-sample records (per-sample when as long as the batch): mappings,
    dataclass instances, named tuples, or lists or tuples of them (a sample's annotations: COCO's
    per-image lists of dicts, some empty); never the batch itself (``top``), which a list of loaders'
    batches can be."""
    if top or not isinstance(value, (list, tuple)) or _named(value) or not value:
        return False
    return _each(value, _record) and any(_record(v) or bool(v) for v in value)


def _record(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        or _named(value)
        or (dataclasses.is_dataclass(value) and not isinstance(value, type))
    )


def _rows(
    batch: Any, *, skip: frozenset[int] | None, top: bool = False, path: str = "batch"
) -> list[tuple[str, int]]:
    """The place (``batch['labels'][0]``) and leading size of each of ``batch``'s tensors of at least one
    dimension, in order, looking into lists, tuples, mappings and dataclasses, but not into lists of
    records whose length is in ``skip`` (per-sample, cut whole), or into any (``skip`` None: the tensors
    that tell the batch's sample count)."""
    if isinstance(batch, Tensor):
        return [(path, int(batch.shape[0]))] if batch.dim() > 0 else []
    if _records(batch, top=top) and (skip is None or len(batch) in skip):
        return []
    items: Any = ()
    if isinstance(batch, (list, tuple)):
        items = ((f"{path}[{k}]", v) for k, v in enumerate(batch))
    elif isinstance(batch, Mapping):
        items = ((f"{path}[{k!r}]", v) for k, v in batch.items())
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = ((f"{path}.{f.name}", getattr(batch, f.name)) for f in dataclasses.fields(batch))
    return [row for inner, value in items for row in _rows(value, skip=skip, path=inner)]


def _check_sizes(rows: list[tuple[str, int]], m: int) -> list[int]:
    """The leading sizes of ``rows`` (:func:`_rows`), after the refusals, which name a tensor of each size
    by its place."""
    sizes = [n for _, n in rows]
    if not sizes:
        return sizes
    where: dict[int, str] = {}
    for place, n in rows:
        where.setdefault(n, place)
    small, large = min(sizes), max(sizes)
    if small < m and large >= m:
        raise ValueError(
            f"A tensor of the batch ({where[small]}) has {small} rows along dim 0 among tensors of"
            f" {large}: every tensor of a"
            f" batch is cut along dim 0 into num_microbatches={m} micro-batches (a list of per-sample tensors"
            " element by element). Expand it to the batch size (a broadcast position_ids of shape (1, T)),"
            " stack or pad per-sample tensors into one, or build it per micro-batch in pipeline_input."
        )
    if small < m:
        raise ValueError(
            f"A batch of {small} samples cannot fill num_microbatches={m}: use a batch size of at least {m}"
            " (with drop_last=True if the dataset leaves a smaller last batch), or fewer micro-batches."
        )
    if small != large and any(n % m for n in sizes):
        raise ValueError(
            f"The batch holds tensors of different leading sizes {sorted(where)}"
            f" ({', '.join(f'{where[n]}: {n}' for n in sorted(where))}) that"
            f" num_microbatches={m} does not divide: their micro-batches would hold other shares of each"
            " (a combined batch of loaders with other batch sizes, a list of per-sample tensors, which is"
            " cut element by element), and no weight makes every micro-batch mean the batch's. Give every"
            f" tensor of a batch the same leading size, or sizes divisible by {m} (drop_last=True on each"
            " loader); stack or pad per-sample tensors into one."
        )
    return sizes


def _split(
    batch: Any, m: int, *, samples: frozenset[int], records: frozenset[int], top: bool = False
) -> list[Any]:
    """``batch`` cut into ``m``; ``samples``: the leading sizes of its tensors (a plain list of one of
    these lengths is per-sample data), ``records``: those of the tensors outside lists of records (such a
    list or tuple of one of these lengths is too, but the batch itself: ``top``)."""
    if isinstance(batch, Tensor):
        return list(batch.tensor_split(m)) if batch.dim() > 0 else [batch] * m
    per_sample = isinstance(batch, list) and _per_sample(batch, samples)
    if per_sample or (_records(batch, top=top) and len(batch) in records):
        return [batch[r] for r in _ranges(len(batch), m)]
    if _named(batch):  # a named tuple takes its fields by position
        parts = [_split(b, m, samples=samples, records=records) for b in batch]
        return [type(batch)(*(p[i] for p in parts)) for i in range(m)]
    if isinstance(batch, (list, tuple)):
        parts = [_split(b, m, samples=samples, records=records) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(m)]
    if isinstance(batch, Mapping):
        parts_d = {k: _split(v, m, samples=samples, records=records) for k, v in batch.items()}
        return [_like(batch, {k: v[i] for k, v in parts_d.items()}) for i in range(m)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = [f.name for f in dataclasses.fields(batch) if f.init]
        parts_f = {name: _split(getattr(batch, name), m, samples=samples, records=records) for name in fields}
        return [dataclasses.replace(batch, **{k: v[i] for k, v in parts_f.items()}) for i in range(m)]
    return [batch] * m


def _named(batch: Any) -> bool:
    return isinstance(batch, tuple) and hasattr(batch, "_fields")


def _per_sample(batch: list[Any], samples: frozenset[int]) -> bool:
    """Whether ``batch`` is a list of plain values (or of lists or tuples of them: a sample's word ids or
    tags), one per sample: as long as a tensor of the batch (a list of another length goes whole into
    every micro-batch)."""
    return len(batch) in samples and _each(batch, _plain)


def _each(values: list[Any] | tuple[Any, ...], leaf: Callable[[Any], bool]) -> bool:
    """Whether every item of ``values`` is a ``leaf``, or a list or tuple of them (one sample's)."""
    return all(leaf(v) or (isinstance(v, (list, tuple)) and all(map(leaf, v))) for v in values)


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN)


def _ranges(n: int, m: int) -> list[slice]:
    """The index ranges ``tensor_split`` cuts ``n`` rows into: the first ``n mod m`` parts one longer."""
    q, r = divmod(n, m)
    starts = [i * q + min(i, r) for i in range(m + 1)]
    return [slice(starts[i], starts[i + 1]) for i in range(m)]


def _like(mapping: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` as a mapping of ``mapping``'s type where that type builds from a dict, else a dict."""
    if type(mapping) is dict:
        return items
    build: Any = type(mapping)
    try:
        return build(items)
    except TypeError:
        return items


def _samples(micro: Any) -> int | None:
    """The leading size of the first tensor of at least one dimension in a micro-batch outside lists of
    records (per-image targets hold any number of rows), else of any (None without)."""
    rows = _rows(micro, skip=None, top=True) or _rows(micro, skip=frozenset(), top=True)
    return rows[0][1] if rows else None


def micro_weights(micro: list[Any]) -> list[float]:
    """``m n_i / N`` per micro-batch of ``n_i`` of ``N`` samples: the factor that makes the mean of the
    micro-batch means (what the schedule computes) the mean over the batch's samples; all 1.0 when the
    micro-batches are equal (any ragged split is then weighted exactly)."""
    sizes = [_samples(mb) for mb in micro]
    if any(n is None for n in sizes) or len(set(sizes)) == 1:
        return [1.0] * len(micro)
    total = sum(n for n in sizes if n is not None)
    return [len(micro) * n / total for n in sizes if n is not None]
