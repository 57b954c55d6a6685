"""`validate`: everything a run's configuration must satisfy, checked once before any process is set up,
any file written or anything compiled; the config it passes is marked (`boostjax.config.is_validated`),
so a job checks it once.

In order: the fields (`boostjax.config.validate`), the hardware profile, what the placement can run
(`boostjax.placement.check`: strategy and mesh against the shapes, pipeline stages, an offload plan),
the data (`boostjax.data.source`: it reads a token file once, in chunks), with
`--init-from-hf`, the checkpoint's tokenizer against a tokenised folder's and `--calib-tokens` against
the data's training split, and last a `--distill-from` teacher (`boostjax.training.distill.check`).
"""

from __future__ import annotations

from boostjax import placement
from boostjax.config import Config, ConfigError, ModelConfig, TrainConfig, mark_validated
from boostjax.config import validate as validate_fields
from boostjax.data.source import Source, check_source, resolve_source
from boostjax.interop.pretrained import check_calibration, check_source_tokenizer
from boostjax.runtime.hardware import check_hardware
from boostjax.training import distill


def check_run_data(t: TrainConfig, m: ModelConfig) -> Source:
    """`train.data` exists, can be read, and holds no token id >= `model.vocab_size`; documents for
    `--doc-mask`. Returns the resolved source."""
    try:
        src = resolve_source(t.data, t.data_dtype, mixtures=True)
        check_source(src, m.vocab_size)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if t.doc_mask and not src.documents:  # a file is one stream: its document boundaries are unknown
        raise ConfigError(f"train.doc_mask: {t.data} is one file with no document boundaries; fix: pass --data with "
                          "a folder of text files (one document each) or a tokenised folder, or drop --doc-mask")
    return src


def validate(cfg: Config) -> Config:
    """Raise the one-line `ConfigError` of the first problem; return `cfg`, marked as checked."""
    validate_fields(cfg)
    if cfg.train.hardware:
        check_hardware(cfg.train.hardware)
    placement.check(cfg)
    source = check_run_data(cfg.train, cfg.model)
    for one in (p.source for p in source.parts) if source.kind == "mixture" else (source,):
        check_source_tokenizer(cfg, one)
    check_calibration(cfg, source)
    distill.check(cfg, source)
    return mark_validated(cfg)
