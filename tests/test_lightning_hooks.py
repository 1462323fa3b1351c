"""The hooks the Trainer strategy sets on the user's objects for one run (``lightning_hooks``): what
``restore`` leaves behind, and the warning when a module's own ``toggle_optimizer`` is not called."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_par import lightning_hooks


class _NoShards:
    def group_params(self, index: int) -> list[list[Any]]:
        return []


def test_restore_puts_back_the_users_attribute_and_keeps_one_set_during_the_run() -> None:
    """A wrapper installed over the user's own instance attribute gives it back at restore (before,
    deleted); one the user set during the run, over the wrapper, stays (before, deleted too); with none,
    the class's method shows through again."""
    module = pl.LightningModule()

    def mine(*args: Any) -> str:
        return "mine"

    module.on_train_end = mine  # type: ignore[method-assign]
    lightning_hooks.install(module, "on_train_end", lambda *a: "wrapper")
    lightning_hooks.install(module, "on_fit_start", lambda *a: "wrapper")
    lightning_hooks.install(module, "on_train_start", lambda *a: "wrapper")

    def set_during_run(*args: Any) -> str:
        return "set during the run"

    module.on_train_start = set_during_run  # type: ignore[method-assign]
    lightning_hooks.restore(module, ["on_train_end", "on_fit_start", "on_train_start"])
    assert vars(module)["on_train_end"] is mine
    assert "on_fit_start" not in vars(module)
    assert vars(module)["on_train_start"] is set_during_run


def test_a_modules_own_toggle_optimizer_is_warned_about_at_zero_1_to_3() -> None:
    class Own(pl.LightningModule):
        def toggle_optimizer(self, optimizer: Any) -> None:
            super().toggle_optimizer(optimizer)

    with pytest.warns(UserWarning, match="your override is not called"):
        names = lightning_hooks.guard_toggling(Own(), sharded=_NoShards(), optimizers=[])  # type: ignore[arg-type]
    assert names == ["toggle_optimizer", "untoggle_optimizer"]
    with warnings.catch_warnings():  # a module without its own: nothing to say
        warnings.simplefilter("error")
        lightning_hooks.guard_toggling(pl.LightningModule(), sharded=_NoShards(), optimizers=[])  # type: ignore[arg-type]
