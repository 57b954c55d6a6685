"""Typed configuration: model shapes, training hyperparameters, the device mesh, presets and validation.

Every field is overridable from the CLI (`--d-model 256`, `--lr 3e-4`, ...); a `Literal` field's values
are the flag's choices. What a field is lives once, as its metadata (`option`): its help text,
its flag (`flag_of`: `--model` for `kind`) and what a resumed run may do with it (`resume_of`); the
CLI (`boostjax.cli.flags`), the run folder's resume check and every message naming a flag read it.
The mesh is parsed once, into a `MeshShape`, when a `TrainConfig` is made. `validate` runs before
anything is compiled and raises `ConfigError` with one line naming the field and the fix; it marks the
config it checked, so a job validates once (`is_validated`).

A leaf: this package imports nothing else of boostjax, so every other module may import it. What needs
more than the fields (the data, the hardware profiles, what a placement can run) is checked by
`boostjax.training.checks.validate`, which marks the config it passed (`is_validated`).

The modules: `names` (the Literal types, their tuples, limits, `ConfigError`), `fields` (`option` and
what a field's metadata says), `mesh` (`MeshShape`), `model` (`ModelConfig`), `train` (`TrainConfig`,
its fields grouped by concern), `job` (`Config`), `presets`, and the checks: `checking` (shared),
`model_checks`, `train_checks` and `validation` (`validate`). Import from `boostjax.config`.
"""

from __future__ import annotations

from boostjax.config.names import (ATTENTION, ATTENTION_MEMORY, CALIBRATED_FACTORS, CLIP_SCOPES, DATA, DATA_DTYPES,
                                   DEFAULT_CALIB_TOKENS, DELAY_SCHEDULES, DELAY_TC_PER_WARMUP, DTYPES, FACTOR_LRS,
                                   INIT_FACTORS,
                                   LOW_RANK_KINDS, MAX_INIT_TIMEOUT, MAX_SEQ_LEN, MAX_TOKENS, MAX_VOCAB, MESH_AXES,
                                   MODEL, MODEL_KINDS, OPTIMIZERS, PIPELINE_SCHEDULES, PROJECTION_GROUPS, RANK_POLICIES,
                                   REMAT, ROPE_TYPES, ROT_GEOMETRIES, ROT_ORDERS, ROT_SOURCES, STAGE, STRATEGIES,
                                   TP_STRATEGIES, ZERO_STAGES, Attention, AttentionMemory, ClipScope, ConfigError,
                                   DataDtype, DelaySchedule, Dtype, InitFactor, ModelKind, Optimizer, PipelineSchedule,
                                   RankPolicy, Remat, RopeType, RotGeometry, RotOrder, RotSource, Strategy, ZeroStage)
from boostjax.config.fields import (RESUME_POLICIES, Resume, config_field, field_names, fields_with, flag_of, help_of,
                                    legacy_values, negated_flag_of, option, resume_of)
from boostjax.config.mesh import MeshShape, as_mesh, mesh_text
from boostjax.config.model import ModelConfig
from boostjax.config.train import TrainConfig, delay_lr_tc_steps, nesterov_psi, warmup_steps
from boostjax.config.job import CONFIG_CLASSES, Config, field_default
from boostjax.config.presets import DEFAULT_PRESET, PRESETS, preset
from boostjax.config.model_checks import validate_model
from boostjax.config.train_checks import parse_profile, validate_train
from boostjax.config.validation import (check_batch_seq, is_validated, mark_validated, validate, validate_process_mesh,
                                        validate_processes)

__all__ = ["ATTENTION", "ATTENTION_MEMORY", "Attention", "AttentionMemory", "CALIBRATED_FACTORS", "CLIP_SCOPES",
           "CONFIG_CLASSES", "ClipScope", "Config", "ConfigError", "DATA", "DATA_DTYPES", "DEFAULT_CALIB_TOKENS",
           "DEFAULT_PRESET", "DELAY_SCHEDULES", "DELAY_TC_PER_WARMUP", "DTYPES", "DataDtype", "FACTOR_LRS", "DelaySchedule", "Dtype",
           "INIT_FACTORS", "InitFactor", "LOW_RANK_KINDS", "MAX_INIT_TIMEOUT", "MAX_SEQ_LEN", "MAX_TOKENS",
           "MAX_VOCAB", "MESH_AXES", "MODEL", "MODEL_KINDS", "MeshShape", "ModelConfig", "ModelKind", "OPTIMIZERS",
           "Optimizer", "PIPELINE_SCHEDULES", "PRESETS", "PROJECTION_GROUPS", "PipelineSchedule", "RANK_POLICIES",
           "REMAT", "RESUME_POLICIES", "ROPE_TYPES", "ROT_GEOMETRIES", "ROT_ORDERS", "ROT_SOURCES", "RankPolicy",
           "Remat", "Resume", "RopeType", "RotGeometry", "RotOrder", "RotSource", "STAGE", "STRATEGIES", "Strategy",
           "TP_STRATEGIES", "TrainConfig", "ZERO_STAGES", "ZeroStage", "as_mesh", "check_batch_seq", "config_field",
           "delay_lr_tc_steps", "field_default", "field_names", "fields_with", "flag_of", "help_of", "is_validated",
           "legacy_values", "mark_validated", "mesh_text", "negated_flag_of", "nesterov_psi", "option",
           "parse_profile", "preset", "resume_of", "validate", "validate_model", "validate_process_mesh",
           "validate_processes", "validate_train", "warmup_steps"]
