"""Pipeline parallelism: partitioning of an ordered layer list, schedules as data, and the runtime."""

from lightning_par.pipeline.hf import hf_causal_lm_loss, hf_pipeline_layers
from lightning_par.pipeline.litgpt import litgpt_pipeline_layers
from lightning_par.pipeline.partition import METHODS, layer_costs, partition
from lightning_par.pipeline.runtime import PipelineRuntime, StepStats
from lightning_par.pipeline.schedule import SCHEDULES, Action, build_schedule, check_schedule, peak_in_flight

__all__ = [
    "METHODS",
    "SCHEDULES",
    "Action",
    "PipelineRuntime",
    "StepStats",
    "build_schedule",
    "check_schedule",
    "hf_causal_lm_loss",
    "hf_pipeline_layers",
    "layer_costs",
    "litgpt_pipeline_layers",
    "partition",
    "peak_in_flight",
]
