"""Optimizers: basis-rotation Adam, asynchronous-pipeline delay emulation and its baselines,
hybrid 8-bit Adam, and the shared learning-rate schedule."""

from boostjax.optim.adam8bit import adam8bit, state_bytes
from boostjax.optim.baselines import make_optimizer, scale_by_stage_delay, stage_refresh_periods
from boostjax.optim.delay import (DelayState, assign_stages, delay_init, delay_push, delayed_params,
                                  delayed_train_step)
from boostjax.optim.rotation import RotatedAdamState, rotated_adam
from boostjax.optim.schedule import lr_schedule

__all__ = ["adam8bit", "state_bytes", "make_optimizer", "scale_by_stage_delay", "stage_refresh_periods",
           "DelayState", "assign_stages", "delay_init", "delay_push", "delayed_params", "delayed_train_step",
           "RotatedAdamState", "rotated_adam", "lr_schedule"]
