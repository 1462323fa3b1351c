"""Reference models that are tensor- and pipeline-parallel ready, and the built-in corpus datamodule."""

from lightning_par.models.corpus import StdlibCorpusDataModule
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.models.lit_gpt import GPTModule

__all__ = ["GPT", "GPTConfig", "GPTModule", "StdlibCorpusDataModule"]
