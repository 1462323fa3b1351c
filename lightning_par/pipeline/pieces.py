"""Views of a model's modules for the pipeline protocol: the base of the pieces that
:func:`~lightning_par.pipeline.hf.hf_pipeline_layers` and
:func:`~lightning_par.pipeline.litgpt.litgpt_pipeline_layers` cut a model into.

A :class:`Piece` registers some of the model's modules under the names they have in their parents (so
the pipeline's split, ZeRO and the tied-weight exchange see the model's own parameters, not copies) and
checks at every forward that the parents still hold them: a tensor-parallel plan swaps modules (the
embedding and the LM head become vocabulary-parallel), and a piece built before that would silently run
the module the model no longer has.

:func:`refuse_compiled` stops a builder given a ``torch.compile``d model: the pipeline runs the pieces,
never the model's forward, so the compile would silently not apply (and its wrapper hides the modules).
Compiled blocks are kept: a piece calls the compiled module it wraps.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch._dynamo import OptimizedModule

Origin = tuple[nn.Module, str]  # (parent module, name of the wrapped child in it)


def refuse_compiled(model: nn.Module, *, builder: str, blocks: str) -> None:
    """Raise if ``model`` is a ``torch.compile`` wrapper; ``blocks`` names where its blocks live."""
    if isinstance(model, OptimizedModule):
        raise TypeError(
            f"{builder} got a torch.compile'd model ({type(model._orig_mod).__name__} inside an"
            " OptimizedModule). Under pipeline parallelism the pieces run, not the model's forward, so"
            " compiling the whole model would have no effect. Pass the model itself and compile its blocks"
            f" instead, e.g. in configure_model(): for i, block in enumerate({blocks}): {blocks}[i] ="
            " torch.compile(block)."
        )


class Piece(nn.Module):
    """A view of the modules ``origins`` (each ``(parent, name)``), built by ``builder`` (the function
    named in the error when a parent no longer holds a module)."""

    def __init__(self, *origins: Origin, builder: str) -> None:
        super().__init__()
        self.__dict__["_origins"], self.__dict__["_builder"] = origins, builder
        for parent, name in origins:
            self.add_module(_attr(name), parent._modules[name])

    def check(self) -> None:
        """Raise unless every wrapped module is still its parent's (a few identity comparisons)."""
        for parent, name in self.__dict__["_origins"]:
            if parent._modules.get(name) is not self._modules[_attr(name)]:
                raise RuntimeError(
                    f"The model's {type(parent).__name__}.{name} was replaced after"
                    f" {self.__dict__['_builder']} built its pieces (a tensor-parallel plan swaps modules),"
                    " so a piece would run the old one. Build the pieces in the first pipeline_layers()"
                    " call, not in configure_model(), and return the same list after."
                )

    def child(self, name: str) -> nn.Module:
        """The wrapped module named ``name`` in its parent."""
        module = self._modules[_attr(name)]
        assert module is not None
        return module


def _attr(name: str) -> str:
    return f"layer_{name}" if name.isdigit() else name


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """Final logit soft-capping as Gemma 2 / 3 apply it (``cap * tanh(logits / cap)``, the same operations
    in the same order, so the result is bitwise the model's); ``logits`` unchanged when ``cap`` is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
