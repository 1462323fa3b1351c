"""Tensor-parallel plans: ``{module-name pattern: style}`` tables, the shipped ones, and how a plan name or
dict resolves to the entries :func:`~lightning_par.tensor_parallel.plan.apply_tensor_parallel` applies.

Patterns are ``fnmatch`` patterns matched against module names relative to the module the plan is
applied to (a leading ``*.`` also matches at the top level: ``"*.attn.q_proj"`` matches ``attn.q_proj``
and ``model.blocks.3.attn.q_proj``). Styles:

================== ==================================================================================
``colwise``        ``nn.Linear`` -> :class:`ColumnParallelLinear` (output stays sharded)
``colwise_gather`` ``nn.Linear`` -> :class:`ColumnParallelLinear` with the output all-gathered
``rowwise``        ``nn.Linear`` -> :class:`RowParallelLinear` (input is the column-parallel shard)
``vocab``          ``nn.Embedding`` -> :class:`VocabParallelEmbedding`
``region_input``   any module (a norm before column-parallel layers) -> its output enters a
                   tensor-parallel region: ``copy_to`` (one gradient all-reduce for all the
                   column-parallel layers that read it); with SP the module runs on sequence shards and
                   its output is all-gathered. Every backward corrects the gradient the all-reduce sums
                   for readers other than the column-parallel layers (a post-LN residual stream, a
                   value head); a column-parallel layer that no region input feeds is refused in its
                   forward (:mod:`~.region_check`)
``sequence_output`` any module (a final norm before a replicated head) -> runs on sequence shards, its
                   output all-gathered, the backward keeping this rank's slice (SP only: where SP ends)
``sequence_local``  any module (a norm on the residual stream between regions) -> runs on sequence
                   shards, its parameters' gradients summed over the group (SP only)
``scatter_sequence`` any module -> output split along the sequence (SP only: where SP starts)
``scatter_sequence_input`` any module -> its input split along the sequence (SP only: where SP starts,
                   for models that compute positions and masks from the embedding's output length)
================== ==================================================================================

Styles combine with ``+`` and apply left to right (``"vocab+scatter_sequence"``).

Shipped plans (``"gpt"`` for :class:`lightning_par.models.GPT`, ``"llama"`` for Llama-style decoders with
``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``embed_tokens``, ``lm_head``;
``"llama_attention"`` the same without the MLP, for mixture-of-experts decoders such as Mixtral and
Qwen-MoE, whose experts stay replicated, no sequence parallelism; ``"litgpt"`` for litgpt's ``GPT``,
whose fused ``attn.qkv`` is cut by heads in each of its query, key and value segments, see
:mod:`~lightning_par.tensor_parallel.litgpt_family`) keep the
model's outputs those of the unsharded model: full logits. With ``sequence_parallel=True`` their SP
entries are added. Weights are sliced from the existing modules, so a seeded or pretrained model keeps
its function; tied weights (embedding and head) stay tied when both sides shard the vocabulary alike.
Attention modules whose projections become column-parallel get their head-count attributes divided.
The Llama plan's SP starts at the first decoder layer's input, so it also fits Hugging Face's
``LlamaForCausalLM``. PEFT LoRA layers (``lora.Linear``: ``base_layer`` + ``lora_A``/``lora_B``) matched by
a linear style are sharded inside their wrapper (:mod:`lightning_par.tensor_parallel.lora`), and so are
PEFT's ``modules_to_save`` copies. A model without the shipped plan's LM head (a classification or
reward head, a bare ``LlamaModel``) keeps its head replicated (:func:`fit_head`), and a block of another
family that a shipped plan's entries match only in part (a LLaVA's CLIP vision tower: ``q/k/v_proj``
beside an ``out_proj``), or beside no norm the plan makes its region input (Qwen2.5-VL's vision MLP),
stays replicated (:func:`whole_blocks`). Parameters keep their
``requires_grad``. A model is converted once (see
:func:`~lightning_par.tensor_parallel.plan.apply_tensor_parallel`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Literal, get_args

from lightning_par.tensor_parallel.litgpt_family import LITGPT_PLAN, LITGPT_SP

Style = Literal[
    "colwise",
    "colwise_gather",
    "rowwise",
    "vocab",
    "region_input",
    "sequence_output",
    "sequence_local",
    "scatter_sequence",
    "scatter_sequence_input",
]
STYLES: tuple[str, ...] = get_args(Style)

GPT_PLAN: dict[str, Style] = {
    "*.embed.tok": "vocab",
    "*.ln_1": "region_input",
    "*.ln_2": "region_input",
    "*.head.norm": "region_input",
    "*.attn.q_proj": "colwise",
    "*.attn.k_proj": "colwise",
    "*.attn.v_proj": "colwise",
    "*.attn.out_proj": "rowwise",
    "*.mlp.fc_in": "colwise",
    "*.mlp.fc_out": "rowwise",
    "*.head.lm_head": "colwise_gather",
}
GPT_SP: dict[str, str] = {"*.embed": "scatter_sequence"}
LLAMA_PLAN: dict[str, Style] = {
    "*.embed_tokens": "vocab",
    "*.input_layernorm": "region_input",
    "*.post_attention_layernorm": "region_input",
    "*.norm": "region_input",
    "*.self_attn.q_proj": "colwise",
    "*.self_attn.k_proj": "colwise",
    "*.self_attn.v_proj": "colwise",
    "*.self_attn.o_proj": "rowwise",
    "*.mlp.gate_proj": "colwise",
    "*.mlp.up_proj": "colwise",
    "*.mlp.down_proj": "rowwise",
    "*.lm_head": "colwise_gather",
}
# SP starts at the first decoder layer's input, not at the embedding's output: Hugging Face's LlamaModel
# builds position ids, rotary tables and the causal mask from the embedding output's length, which must
# stay the full sequence (the attention sees the full sequence, gathered by input_layernorm)
LLAMA_SP: dict[str, str] = {"*.layers.0": "scatter_sequence_input"}
# attention and embedding sharded, the MLP replicated (a mixture of experts, whose experts no shipped plan
# shards): its input norm is no region input, since a replicated consumer's input gradient, equal on every
# rank, would be summed over the group (t times; measured on Mixtral: embedding gradients 0.02 apart)
LLAMA_ATTENTION_PLAN: dict[str, Style] = {
    k: v for k, v in LLAMA_PLAN.items() if ".mlp." not in k and k != "*.post_attention_layernorm"
}
PLANS: dict[str, tuple[Mapping[str, str], Mapping[str, str]]] = {
    "gpt": (GPT_PLAN, GPT_SP),
    "llama": (LLAMA_PLAN, LLAMA_SP),
    "llama_attention": (LLAMA_ATTENTION_PLAN, {}),
    "litgpt": (LITGPT_PLAN, LITGPT_SP),
}


def resolve_plan(plan: str | Mapping[str, str], *, sequence_parallel: bool = False) -> dict[str, str]:
    """A plan name or dict -> a checked ``{pattern: style}`` dict (SP entries added for shipped plans)."""
    if isinstance(plan, str):
        if plan not in PLANS:
            raise ValueError(f"Unknown tp_plan {plan!r}; shipped plans are {sorted(PLANS)}, or pass a dict.")
        base, sp = PLANS[plan]
        if sequence_parallel and not sp:
            raise ValueError(
                f"tp_plan={plan!r} has no sequence-parallel form (its replicated MLP would need whole"
                " sequences); use sequence_parallel=False."
            )
        resolved: dict[str, str] = dict(base)
        if sequence_parallel:
            resolved.update(sp)
        return resolved
    for pattern, style in plan.items():
        for part in style.split("+"):
            if part not in STYLES:
                raise ValueError(
                    f"tp_plan[{pattern!r}] = {style!r}: {part!r} is not a style; use one of {STYLES}"
                    " (several joined by '+', e.g. 'vocab+scatter_sequence')."
                )
    return dict(plan)


def matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase("." + name, pattern)


# A shipped plan's (LM head, final norm) entries: the norm is a region input for the column-parallel head
HEADS: dict[str, tuple[str, str]] = {
    "llama": ("*.lm_head", "*.norm"),
    "llama_attention": ("*.lm_head", "*.norm"),
    "litgpt": ("*.lm_head", "*.transformer.ln_f"),
}


def fit_head(
    resolved: dict[str, str], plan: str | Mapping[str, str], names: list[str], sp: bool
) -> dict[str, str]:
    """A model without the shipped plan's LM head (a sequence-classification or reward head, a bare base
    model) keeps its head replicated, and its final norm is no region input: ``copy_to`` (or, with
    sequence parallelism, the gather's reduce-scatter) would sum the replicated head's equal input
    gradients over the group (``t`` times the gradient). Under SP the norm ends it: ``sequence_output``."""
    head = HEADS.get(plan) if isinstance(plan, str) else None
    if head is None or any(matches(n, head[0]) for n in names):
        return resolved
    fitted = {k: v for k, v in resolved.items() if k not in head}
    if sp:
        fitted[head[1]] = "sequence_output"
    return fitted


def whole_blocks(
    hit_styles: dict[str, list[str]], plan: str | Mapping[str, str]
) -> tuple[dict[str, list[str]], list[str]]:
    """For a shipped plan: the matches without the blocks it would split only in part, and those blocks.

    A shipped plan's column- and row-parallel entries come in pairs inside one block (an attention's
    ``q/k/v_proj`` with its ``o_proj``, an MLP's ``gate/up_proj`` with its ``down_proj``); a block of
    another family matched by some of them only (the CLIP or SigLIP vision tower of a LLaVA, PaliGemma or
    Gemma 3 model: ``self_attn.{q,k,v}_proj`` beside an ``out_proj``) would leave its sharded outputs
    unjoined, so it stays replicated, as a dict plan scoped to the language model would leave it; and so
    does a block matched in full beside no norm the plan makes its region input (Qwen2.5-VL's vision
    MLP, ``gate/up/down_proj`` beside ``norm2``), whose column-parallel layers would read no region."""
    if not isinstance(plan, str):
        return hit_styles, []
    kinds: dict[str, set[str]] = {}
    regions = {n.rpartition(".")[0] for n, styles in hit_styles.items() if "region_input" in styles}
    for name, styles in hit_styles.items():
        parent = name.rpartition(".")[0]
        kinds.setdefault(parent, set()).update(s for s in styles if s in ("colwise", "rowwise"))
    partial = sorted(
        p for p, k in kinds.items() if len(k) == 1 or (k and regions and p.rpartition(".")[0] not in regions)
    )
    kept = {n: s for n, s in hit_styles.items() if n.rpartition(".")[0] not in partial}
    return kept, partial


def experts_hint(plan: str | Mapping[str, str], pattern: str, names: list[str]) -> str:
    """For a shipped plan's MLP entry on a mixture-of-experts model: the plan to pass instead; for a
    Llama plan on a litgpt GPT: ``"litgpt"``."""
    if isinstance(plan, str) and plan != "litgpt" and any(n.endswith(".attn.qkv") for n in names):
        return " The model looks like litgpt's GPT (attn.qkv): use tp_plan='litgpt'."
    experts = next((n for n in names if n.rsplit(".", 1)[-1] == "experts"), None)
    if plan != "llama" or ".mlp." not in pattern or experts is None:
        return ""
    return (
        f" The model's MLP is a mixture of experts ({experts!r}), which the 'llama' plan does not shard:"
        " tp_plan='llama_attention' shards attention and embedding and keeps the MLP replicated."
    )
