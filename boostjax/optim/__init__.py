"""Optimizers: basis-rotation Adam, asynchronous-pipeline delay emulation and its baselines,
hybrid 8-bit Adam, the shared learning-rate schedule, and the one registry that builds them."""

from boostjax.optim.adam8bit import adam8bit, state_bytes
from boostjax.optim.delay import DelayState, assign_stages, delay_init, delay_push, delayed_params
from boostjax.optim.pipedream import scale_by_stage_delay, stage_refresh_periods
from boostjax.optim.registry import OPTIMIZERS, build_optimizer, current_lr, make_optimizer, state_specs
from boostjax.optim.rotation import RotatedAdamState, rotated_adam, scale_by_rotated_adam
from boostjax.optim.schedule import lr_schedule

__all__ = ["adam8bit", "state_bytes", "make_optimizer", "build_optimizer", "current_lr", "state_specs",
           "OPTIMIZERS", "scale_by_stage_delay", "stage_refresh_periods",
           "DelayState", "assign_stages", "delay_init", "delay_push", "delayed_params",
           "RotatedAdamState", "rotated_adam", "scale_by_rotated_adam", "lr_schedule"]
