"""`TrainConfig`: everything `boostjax train` needs besides the model shapes, its fields grouped by
concern; and the schedule lengths derived from them (`warmup_steps`, `delay_lr_tc_steps`, `nesterov_psi`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from boostjax.config.fields import option
from boostjax.config.mesh import MeshShape, as_mesh
from boostjax.config.names import (DEFAULT_CALIB_TOKENS, DELAY_TC_PER_WARMUP, ClipScope, DataDtype, DelaySchedule,
                                   Dtype, FactorLr, InitFactor, Optimizer, PipelineSchedule, RankPolicy, Remat, RotGeometry,
                                   RotOrder, RotSource, Strategy, ZeroStage)


@dataclass(frozen=True)
class TrainConfig:
    """Everything `boostjax train` needs besides the model shapes.

    Each field's help text, command-line flag and resume policy are its metadata (`option`)."""

    # -- the run
    out: str = option("runs/default", "run folder (config.json, metrics.jsonl, checkpoints/); an existing run "
                                      "there is resumed", resume="ignored")
    steps: int = option(600, "optimizer steps of the whole run (a resumed run may raise it)", resume="mutable")
    seed: int = option(0, "seed of the parameter init and of the data order (batch k is a pure function of "
                          "the seed and k)")
    dtype: Dtype = option("float32", "compute dtype; parameters and optimizer state stay fp32", resume="mutable")

    # -- data and batch
    data: str = option("", "corpus: '' = this Python's standard library sources; a folder written by boostjax "
                           "tokenize (its meta.json gives the dtype and, without --vocab-size, the vocabulary), a "
                           ".bin token file, a text file or a folder of text files; tokenised folders mixed by weight: "
                           "A:0.7,B:0.3 (A,B: equal weights; docs/data.md, Mixtures)")
    data_dtype: DataDtype = option("uint16", "with a .bin token file as --data: its element type")
    # documents: batches carry segment ids and attention never crosses a document boundary
    doc_mask: bool = option(False, "mask attention at document boundaries: packed documents carry a document id "
                                   "per token and a token attends only to its own document (needs --data with "
                                   "documents: the built-in corpus, a folder or a tokenised folder; not with "
                                   "--attention cudnn or a stage axis in --mesh)")
    batch: int = option(16, "sequences (rows) per optimizer step, over all devices (per micro-batch with "
                            "--grad-accum)")
    seq: int = option(128, "tokens per sequence; at most the model's max_seq_len")
    grad_accum: int = option(1, "micro-batches of --batch rows per optimizer step (a lax.scan sums their "
                                "gradients); the effective batch is batch x grad_accum; not with --offload-plan")

    # -- optimisation: the learning-rate schedule (boostjax.optim.schedule), the optimizer and clipping
    optimizer: Optimizer = option(
        "adamw", "optimizer: adamw (optax AdamW; PipeDream under --pipeline-delay), rotation (Adam in a rotated "
                 "Kronecker eigenbasis), pipedream-lr (AdamW, update scaled down by the stage delay), nesterov "
                 "(torch NAdam), adam8bit (AdamW with block-wise 8-bit moments and fused clipping), muon (Muon on "
                 "the hidden matrices, update RMS matched to AdamW's so --lr carries over; AdamW on embeddings, "
                 "head and vectors)")
    lr: float = option(3e-3, "peak learning rate (after warmup; cosine decay to min_lr_ratio x lr at the last "
                             "step)", resume="mutable")
    min_lr_ratio: float = option(0.1, "final learning rate of the cosine decay, as a fraction of --lr, in [0, 1]",
                                 resume="mutable")
    warmup: int = option(-1, "linear warmup steps from 0 to --lr; -1 = 5 % of the run (steps // 20)",
                         resume="mutable")
    weight_decay: float = option(0.01, "decoupled (AdamW-style) weight decay", resume="mutable")
    b1: float = option(0.9, "Adam beta1: EMA factor of the first moment, in [0, 1)", resume="mutable")
    b2: float = option(0.95, "Adam beta2: EMA factor of the second moment, in [0, 1)", resume="mutable")
    clip: float = option(1.0, "gradient clipping threshold (global norm, or each stage's with --clip-scope "
                              "stage); 0 disables it", resume="mutable")
    clip_scope: ClipScope = option("global", "what one clipping norm covers: global (every parameter) or stage "
                                             "(with --pipeline-delay: each stage clips its own parameters, as "
                                             "every device of an asynchronous pipeline does; not with --optimizer "
                                             "adam8bit)", resume="mutable")
    factor_lr: FactorLr = option("fixed", "how AdamW steps low-rank factors: fixed (as every parameter) or "
                                          "start-rms (each factor's step scaled by its RMS at the start over the "
                                          "median RMS of the other matrices, so a factored pretrained start whose "
                                          "factors are far from the dense scale, as CoLA's, moves every matrix by "
                                          "the same fraction per step)")
    nesterov_psi: float = option(-1.0, "with --optimizer nesterov: torch NAdam's momentum_decay psi (mu_t = b1 (1 - "
                                       "0.96^(psi t) / 2)); -1 = scaled to the run so mu_t reaches 0.9 at 4 % of "
                                       "--steps, as torch's 0.004 does in the reference's ~250k-step run",
                                 resume="follow-stored", legacy=0.004)

    # -- the rotation optimizer (--optimizer rotation, boostjax.optim.rotation)
    rot_source: RotSource = option("second", "with --optimizer rotation: the basis from the second moment (EMA of "
                                             "G G^T / G^T G) or the first (the momentum's singular vectors)")
    rot_geometry: RotGeometry = option("bilateral", "with --optimizer rotation: rotate both sides of each matrix, "
                                                    "or only the smaller one (unilateral)")
    rot_refresh: int = option(10, "with --optimizer rotation: refresh the basis every T steps", resume="mutable")
    rot_beta: float = option(0.95, "with --optimizer rotation: EMA factor of G G^T / G^T G (SOAP's 0.95: the basis "
                                   "must follow the current curvature)", resume="mutable")
    rot_max_dim: int = option(4096, "with --optimizer rotation: a matrix side larger than this is not rotated")
    rot_order: RotOrder = option(
        "previous", "with --optimizer rotation: 'previous' projects G_t on bases built from earlier gradients "
                    "(SOAP); 'current' updates the Gram EMA with G_t, refreshes if due (step 1, every rot_refresh "
                    "steps), then projects (the basis-rotation reference code)")
    rot_damping: float = option(4.0, "with --optimizer rotation: the refreshes iterate on the Gram statistic plus "
                                     "this times its mean eigenvalue (bases far less sensitive to rounding, so a "
                                     "mesh run follows one device); 0 = the paper's exact eigh and undamped power "
                                     "steps", resume="follow-stored", legacy=0.0)
    stage_aware_refresh: bool = option(False, "with --optimizer rotation and --pipeline-delay: stages with a "
                                              "larger delay refresh their basis more often", resume="mutable")

    # -- the asynchronous-pipeline emulation (--pipeline-delay, boostjax.optim.delay)
    pipeline_delay: int = option(1, "emulate an asynchronous pipeline of S stages (PipeDream's weight "
                                    "stashing): stage s takes its gradient at weights S-1-s updates old; stages "
                                    "are contiguous layer groups (1 = no delay)")
    delay_schedule: DelaySchedule = option(
        "pipedream", "with --pipeline-delay S > 1, the stages' delays: pipedream (stage s is S-1-s updates "
                     "behind) or 2bw (PipeDream-2BW: every stage one update behind whatever S; double-buffered "
                     "weights)")
    delay_lr_tc: int = option(0, "with --optimizer pipedream-lr: steps T_c until the delay-scaled learning rate "
                                 "reaches lr; 0 = 7/3 of the warmup (the reference: 7 epochs of correction, 3 of "
                                 "warmup)", resume="follow-stored")

    # -- parallelism: the device mesh, tensor parallelism, ZeRO and the pipeline
    strategy: Strategy = option("none", "tensor-parallel strategy over the mesh's model axis: none, fullrank-tp "
                                        "(Megatron, llama only), vanilla-tp (low-rank factors split along r), "
                                        "btp (BOOST's bottleneck TP, low-rank kinds); all but none need --mesh",
                                resume="mutable")
    # "data=D,stage=P,model=T" or a MeshShape (parsed in __post_init__); None (or "") = one device, no mesh
    mesh: MeshShape | None = option(None, "device mesh, e.g. data=2,stage=2,model=4 ('' = one device, no mesh; "
                                          "CPU devices are simulated as needed); a model axis > 1 needs --strategy",
                                    resume="mutable")
    microbatches: int = option(0, "pipeline micro-batches per data shard; needs stage=P (P >= 2) in --mesh (0 = "
                                  "auto: the largest divisor of the shard's batch that is <= 4 x stages; see "
                                  "boostjax.sharding.pipeline)", resume="mutable")
    zero: ZeroStage = option(0, "data-parallel state sharding (ZeRO) over the --mesh data axis: 0 replicated, 1 "
                                "optimizer state split over data, 3 parameters too; not with --offload-plan",
                             resume="mutable")
    pipeline_schedule: PipelineSchedule = option(
        "gpipe", "pipeline schedule; needs stage=P (P >= 2) in --mesh: gpipe (all forwards, then all backwards; "
                 "activations of every micro-batch) or 1f1b (one forward, one backward; activations of about "
                 "2 x stages micro-batches, not M + P - 1); the same bubble (P-1)/(M+P-1)", resume="mutable")

    # -- memory: rematerialisation and the offload plan
    remat: Remat = option("none", "rematerialisation: none, full (recompute each block in the backward), "
                                  "lowrank (keep the r-dim latents, recompute the rest; no collective "
                                  "recomputed)", resume="mutable")
    offload_plan: str = option("", "plan.json from boostjax plan (made with this run's flags): per-layer "
                                   "remat/offload policies, host-resident parameters and optimizer states; not "
                                   "with --grad-accum or --zero; '' = none", resume="mutable")

    # -- multi-host (boostjax.runtime.multihost): coordinator, num_processes and process_id all three, or none
    # to read BOOSTJAX_* or a scheduler's variables
    coordinator: str = option("", "multi-host, with --num-processes and --process-id (all three or none): "
                                  "HOST:PORT of process 0's coordination service ('' = from BOOSTJAX_COORDINATOR "
                                  "or a SLURM / mpiexec / Kubernetes job)", resume="ignored")
    num_processes: int = option(0, "multi-host, with --coordinator, --process-id and a --mesh over every "
                                   "process's devices: processes in the job (0 = from the environment, 1 process "
                                   "if none; 1 = force one)", resume="ignored")
    process_id: int = option(-1, "multi-host, with --coordinator and --num-processes: this process's index, "
                                 "0..num_processes-1 (-1 = from the environment)", resume="ignored")
    init_timeout: int = option(300, "multi-host: seconds a process waits for the whole job to join before it "
                                    "gives up", resume="mutable")

    # -- checkpoints
    ckpt_every: int = option(100, "save a checkpoint every N steps (and at the last step)", resume="mutable")
    keep_ckpts: int = option(3, "checkpoints kept in OUT/checkpoints/ (older ones are deleted)", resume="mutable")

    # -- observability (boostjax.training.observe): what a run shows, not what it computes
    log_every: int = option(10, "write a metrics.jsonl record (loss, grad_norm, lr, throughput) every N steps",
                            resume="mutable")
    eval_every: int = option(100, "validation loss every N steps (and at the last step)", resume="mutable")
    eval_batches: int = option(4, "held-out batches averaged for each validation loss", resume="mutable")
    eval_at_start: bool = option(False, "validation loss at step 0 too, before the first update (the 'before' of a "
                                        "fine-tune; a resumed run does not repeat it)", resume="mutable")
    progress: bool = option(True, "progress bars on stderr (--no-progress: none, e.g. in log files)",
                            resume="ignored")
    tensorboard: bool = option(True, "write TensorBoard event files (the metrics.jsonl scalars) into "
                                     "OUT/tensorboard/ (process 0)", resume="mutable")
    profile: str = option("", "START:STOP: a jax.profiler trace of steps START..STOP-1 (0-based) into "
                              "OUT/profile/ ('' = none)", resume="mutable")
    hardware: str = option("", "hardware profile for the MFU metric (peak BF16 FLOP/s per device), a name or "
                               "alias of boostjax.runtime.profiles, e.g. H800-80GB, A100-80GB, RTX3090-24GB; '' = "
                               "detect from the device (none on a CPU)", resume="mutable")

    # -- distillation (boostjax.training.distill): loss = W T^2 KL(teacher || student at temperature T) + (1 - W) CE
    distill_from: str = option("", "train on KL to a frozen teacher's logits: a Hugging Face LLaMA folder, a Llama "
                                   ".gguf file or a boostjax run folder (its newest checkpoint) of the student's "
                                   "vocabulary and the data's tokenizer; '' = no teacher")
    distill_temperature: float = option(1.0, "with --distill-from: temperature T of both softmaxes in the KL term "
                                             "(the term is scaled by T^2); > 0", resume="mutable")
    distill_weight: float = option(0.5, "with --distill-from: W, the KL term's share of the loss (1 - W on the "
                                        "cross-entropy to the data), in [0, 1]", resume="mutable")

    # -- initialisation from a pretrained checkpoint (boostjax.interop.pretrained; "" = random init)
    init_from_hf: str = option("", "start a new run from a Hugging Face LLaMA folder or a Llama .gguf file "
                                   "(needs boostjax[gguf]) (its shapes; --model "
                                   "svd/cola/lax --rank r factors each projection by truncated SVD, or see "
                                   "--init-factor; init_report.json holds the errors); '' = random init")
    init_factor: InitFactor = option(
        "svd", "with --init-from-hf: how a low-rank --model factors the pretrained weights: svd (truncated SVD of each "
               "weight), whitened (SVD-LLM's truncation-aware whitening: the truncation that least changes each "
               "projection's output on the model's own activations on --calib-tokens tokens of --data; cola at "
               "half its rank), linearised (whitened at the full rank; cola through SiLU's small-signal "
               "linearisation), refit (linearised, then each B refitted by ridge least squares on the real "
               "activations) or sequential (refit, each layer on the inputs the already factored layers below "
               "produce); all but svd need --data")
    calib_tokens: int = option(
        0, f"needs --init-factor whitened: the tokens at the start of --data's training split whose activations the "
           f"factors are fitted to; 0 = {DEFAULT_CALIB_TOKENS} (or the whole split when it is shorter); "
           "--init-factor svd reads none")
    rank_budget: float = option(
        0.0, "with --init-from-hf and a low-rank --model: the share F of the dense projection parameters the "
             "factors may hold (0 < F < 1), turned into --rank-attn/--rank-kv/--rank-mlp by --rank-policy; "
             "0 = the ranks are given")
    rank_policy: RankPolicy = option(
        "uniform", "how --rank-budget becomes ranks: uniform (one rank for every group, the largest that fits; a "
                   "group whose factors would not be smaller stays dense) or sensitivity (per group, the ranks "
                   "that least raise the whitened truncation loss, measured on --calib-tokens tokens of --data)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", as_mesh(self.mesh))  # the one parse of a mesh string

    @property
    def sizes(self) -> MeshShape:
        """The mesh's axis sizes; all ones for one device (`mesh` None)."""
        return self.mesh or MeshShape()


def warmup_steps(t: TrainConfig) -> int:
    return t.warmup if t.warmup >= 0 else t.steps // 20


def delay_lr_tc_steps(t: TrainConfig) -> int:
    """PipeDream-LR's T_c: `--delay-lr-tc`, or (0) 7/3 of the warmup, at least 1 step."""
    return t.delay_lr_tc if t.delay_lr_tc > 0 else max(1, round(DELAY_TC_PER_WARMUP * warmup_steps(t)))


def nesterov_psi(t: TrainConfig, b1: float = 0.99, mu: float = 0.9, at: float = 0.04) -> float:
    """torch NAdam's momentum_decay: `--nesterov-psi`, or (-1) the psi with which mu_t = b1 (1 - 0.96^(psi t)
    / 2) reaches `mu` at `at` x steps (torch's 0.004 reaches 0.9 at step ~10.4k, 4 % of a 250k-step run)."""
    if t.nesterov_psi >= 0:
        return t.nesterov_psi
    return math.log(2 * (1 - mu / b1)) / (math.log(0.96) * max(1.0, at * t.steps))
