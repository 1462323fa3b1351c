"""A byte-level corpus that needs no download: the Python standard library's own source files.

The corpus is a fixed, sorted list of stdlib modules (:data:`STDLIB_MODULES`) concatenated in that order,
so one Python version always yields the same bytes. Tokens are bytes (vocabulary 256). If the stdlib
sources are not on disk (e.g. a stripped container), a seeded synthetic corpus takes their place and a
warning says so.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

__all__ = ["STDLIB_MODULES", "CorpusSource", "StdlibCorpusDataModule", "TokenWindows", "load_corpus_bytes"]

CorpusSource = Literal["stdlib", "synthetic"]

# Present (as these paths) in CPython 3.10-3.13; sorted so the concatenation order is explicit.
STDLIB_MODULES: tuple[str, ...] = (
    "abc.py",
    "argparse.py",
    "ast.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "difflib.py",
    "dis.py",
    "enum.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "glob.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "operator.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "shlex.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "traceback.py",
    "typing.py",
    "weakref.py",
)

_SEPARATOR = b"\n\n"
# Below this the stdlib read is treated as failed: too little text to train or validate on.
_MIN_CORPUS_BYTES = 64 * 1024
_SYNTHETIC_BYTES = 400_000
_SYNTHETIC_SEED = 1234

_WORDS = (
    "the", "model", "reads", "each", "token", "and", "predicts", "next", "one", "while", "optimizer",
    "updates", "every", "weight", "a", "batch", "of", "data", "moves", "through", "layers", "attention",
    "loss", "falls", "as", "training", "goes", "on", "gradients", "flow", "back", "from", "output", "so",
    "parameter", "learns", "what", "it", "should", "do",
)  # fmt: skip
_NAMES = ("value", "items", "count", "total", "buffer", "result", "index", "node", "key", "state")


def _synthetic_corpus(num_bytes: int) -> bytes:
    """Deterministic pseudo-English prose interleaved with pseudo-Python functions (ASCII only)."""
    rng = random.Random(_SYNTHETIC_SEED)
    parts: list[str] = []
    size = 0
    while size < num_bytes:
        if rng.random() < 0.5:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
            text = " ".join(words).capitalize() + ".\n"
        else:
            name, arg, var = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_NAMES)
            doc = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
            text = (
                f"def {name}_{rng.randint(0, 99)}({arg}):\n"
                f'    """{doc.capitalize()}."""\n'
                f"    {var} = {arg} {rng.choice('+-*')} {rng.randint(1, 9)}\n"
                f"    return {var}\n\n"
            )
        parts.append(text)
        size += len(text)
    return "".join(parts).encode("ascii")[:num_bytes]


def load_corpus_bytes(
    *, stdlib_dir: str | None = None, max_bytes: int | None = None
) -> tuple[bytes, CorpusSource]:
    """The corpus bytes and where they came from.

    Reads :data:`STDLIB_MODULES` under ``stdlib_dir`` (default: this interpreter's stdlib), skipping
    missing files, joined by a blank line. If fewer than 64 KiB were found, returns the synthetic corpus
    instead (with a warning). The result is truncated to ``max_bytes`` when given.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes}.")
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    for rel in STDLIB_MODULES:
        try:
            chunks.append((root / rel).read_bytes())
        except OSError:
            continue  # a missing module only shortens the corpus; the minimum below guards the rest
    data = _SEPARATOR.join(chunks)
    source: CorpusSource = "stdlib"
    if len(data) < _MIN_CORPUS_BYTES:
        rank_zero_warn(
            f"Found only {len(data)} bytes of stdlib sources under {str(root)!r} (need {_MIN_CORPUS_BYTES}); "
            "using the built-in synthetic corpus instead. Pass stdlib_dir=<path to a CPython Lib/> to "
            "train on real text.",
            category=UserWarning,
        )
        data = _synthetic_corpus(_SYNTHETIC_BYTES)
        source = "synthetic"
    if max_bytes is not None:
        data = data[:max_bytes]
    return data, source


class TokenWindows(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping next-token windows over a 1-D uint8 token tensor.

    Sample ``i`` is ``(x, y)`` with ``x = data[i*T : i*T + T]`` and ``y = data[i*T + 1 : i*T + T + 1]``
    (int64), ``T = block_size``; there are ``(len(data) - 1) // T`` samples.
    """

    def __init__(self, data: Tensor, *, block_size: int) -> None:
        if data.dim() != 1:
            raise ValueError(f"TokenWindows expects a 1-D token tensor, got shape {tuple(data.shape)}.")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return max((self.data.numel() - 1) // self.block_size, 0)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"TokenWindows index {index} out of range [0, {len(self)}).")
        start = index * self.block_size
        # Stored as uint8 (1 byte/token); widened per sample because embeddings and the loss need int64.
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibCorpusDataModule(pl.LightningDataModule):
    """Byte-level language-modelling data from the stdlib corpus (see :func:`load_corpus_bytes`).

    The first ``1 - val_fraction`` of the bytes are the training split, the rest validation (also used for
    test and predict). Batches are ``(x, y)`` int64 tensors of shape (batch_size, block_size). Training
    order is shuffled with a generator seeded by ``seed``; under multi-process strategies Lightning
    replaces the sampler with a ``DistributedSampler``.
    """

    vocab_size: int = 256

    def __init__(
        self,
        *,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: int | None = 2_000_000,
        num_workers: int = 0,
        stdlib_dir: str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size}.")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes}.")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}.")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.stdlib_dir = stdlib_dir
        self.seed = seed
        self._source: CorpusSource | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    @property
    def corpus_source(self) -> CorpusSource:
        """``"stdlib"`` or ``"synthetic"``; available after :meth:`setup`."""
        if self._source is None:
            raise RuntimeError("StdlibCorpusDataModule.corpus_source is known only after setup().")
        return self._source

    def prepare_data(self) -> None:
        """Nothing to download: the corpus is read from local files in :meth:`setup`."""

    def setup(self, stage: str | None = None) -> None:
        """Read the corpus and build both splits (all stages share them; repeated calls are no-ops)."""
        if self.train_set is not None:
            return
        data, source = load_corpus_bytes(stdlib_dir=self.stdlib_dir, max_bytes=self.max_bytes)
        # bytearray: torch.frombuffer needs a writable buffer; clone so the tensor owns its storage.
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
        n_train = int(len(tokens) * (1.0 - self.val_fraction))
        need = self.block_size + 1
        n_val = len(tokens) - n_train
        if n_train < need or n_val < need:
            raise ValueError(
                f"Corpus of {len(tokens)} bytes splits into {n_train} train / {n_val} val bytes, but each "
                f"split needs at least block_size + 1 = {need}; raise max_bytes or val_fraction, or "
                "lower block_size."
            )
        self.train_set = TokenWindows(tokens[:n_train], block_size=self.block_size)
        self.val_set = TokenWindows(tokens[n_train:], block_size=self.block_size)
        self._source = source

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        return self._loader(self._require(self.train_set), shuffle=True, drop_last=True, generator=generator)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(self._require(self.val_set), shuffle=False, drop_last=False)

    def test_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self.val_dataloader()

    def _loader(
        self,
        dataset: TokenWindows,
        *,
        shuffle: bool,
        drop_last: bool,
        generator: torch.Generator | None = None,
    ) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=generator,
        )

    @staticmethod
    def _require(dataset: TokenWindows | None) -> TokenWindows:
        if dataset is None:
            raise RuntimeError("StdlibCorpusDataModule.setup() must run before requesting a dataloader.")
        return dataset
