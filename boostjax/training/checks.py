"""`validate`: everything a run's configuration must satisfy, checked once before any process is set up,
any file written or anything compiled; the config it passes is marked (`boostjax.config.is_validated`),
so a job checks it once.

In order: the fields (`boostjax.config.validate`), the hardware profile, what the placement can run
(`boostjax.placement.check`: strategy and mesh against the shapes, pipeline stages, an offload plan),
and last the data (it reads a token file once, in chunks).
"""

from __future__ import annotations

import os

from boostjax import placement
from boostjax.config import Config, ConfigError, ModelConfig, TrainConfig, mark_validated
from boostjax.config import validate as validate_fields
from boostjax.data import check_data
from boostjax.runtime.hardware import check_hardware


def check_run_data(t: TrainConfig, m: ModelConfig) -> None:
    """`train.data` exists, can be read, and holds no token id >= `model.vocab_size`; documents for
    `--doc-mask`."""
    try:
        check_data(t.data, t.data_dtype, m.vocab_size)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if t.doc_mask and os.path.isfile(t.data):  # a file is one stream: its document boundaries are unknown
        raise ConfigError(f"train.doc_mask: {t.data} is one file with no document boundaries; fix: pass --data with "
                          "a folder of text files (one document each) or a tokenised folder, or drop --doc-mask")


def validate(cfg: Config) -> Config:
    """Raise the one-line `ConfigError` of the first problem; return `cfg`, marked as checked."""
    validate_fields(cfg)
    if cfg.train.hardware:
        check_hardware(cfg.train.hardware)
    placement.check(cfg)
    check_run_data(cfg.train, cfg.model)
    return mark_validated(cfg)
