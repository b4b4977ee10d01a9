"""The one place that defines a setting and its default.

A run is described by one YAML file validated against the typed schema below.
Precedence, lowest to highest: the defaults here < the YAML file < CLI overrides
(``section.key=value``). Validation collects every problem and reports them together,
one per line, so a user fixes a config in one round trip instead of ten.

Command line::

    python -m purrsight.config check config/train_config.yaml trainer.max_steps=20

exits 0 when the config is valid and 2 (one line per problem) when it is not.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from purrsight.atomic_file import write_text_atomically
from purrsight.errors import ExitCode, UserError

AUTO = "auto"  # data.batch_size and model.llm.gradient_checkpointing: chosen at start from the estimate


class AutoUnresolvedError(RuntimeError):
    """A setting left ``auto`` was read before the start decided it: a bug, not a user's mistake."""

    def __init__(self, key: str) -> None:
        super().__init__(f"{key}=auto is decided at start (purrsight/training/auto_settings.py) before anything reads it")


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float.

    PyYAML follows YAML 1.1, where a float needs a dot (``1.0e-3``); ``lr: 1e-3`` would
    arrive as the string "1e-3" and be refused by the strict schema. Users write the
    short form, so the float resolver is widened; everything else stays SafeLoader.
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def safe_yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


class ConfigError(UserError):
    """A config that cannot be used; ``problems`` holds one readable line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems), problems=problems)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[str]]]:
        return type(self), (self.problems,)  # pickled across processes with its lines intact

    def print_problems(self) -> None:
        """One ``config error: …`` line per problem on stderr, as the command-line checks print them."""
        print("\n".join(f"config error: {line}" for line in self.problems), file=sys.stderr)


class _Section(BaseModel):
    # Unknown keys are errors (a typo must not silently fall back to a default), and
    # values are not coerced across types ("8" is not an int) except int -> float.
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


class RunConfig(_Section):
    name: str = Field("phase2-tiny", description="Run name; the run folder is output_dir/name.")
    output_dir: str = Field("runs", description="Parent folder of run folders (checkpoints, logs, resolved config).")
    seed: int = Field(1234, description="Seeds python, numpy and torch; each rank derives its own stream.")
    deterministic: bool = Field(False, description="torch deterministic algorithms; exact resume on CPU, slower on GPU.")
    if_exists: Literal["refuse", "archive", "overwrite"] = Field(
        "refuse",
        description="A start without resume into a folder holding a run: refuse (exit 2), archive it beside, or overwrite it.",
    )

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


class EncoderConfig(_Section):
    """A frozen modality encoder: a local Hugging Face directory or a config dict."""

    enabled: bool = Field(True, description="False drops the modality: its samples train without a prefix.")
    path: str | None = Field(None, description="Local Hugging Face model directory (AutoModel + its processor).")
    config: dict[str, Any] | None = Field(None, description="Config dict for a random-init encoder (tiny default).")
    model_type: Literal["vit", "siglip", "wav2vec2"] | None = Field(
        None, description="Architecture of `config` (needed with config)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EncoderConfig:
        if self.enabled and (self.path is None) == (self.config is None):
            raise ValueError("set exactly one of path or config")
        if self.config is not None and self.model_type is None:
            raise ValueError("model_type is required with config (vit, siglip or wav2vec2)")
        return self


class LoRAConfig(_Section):
    r: int = Field(8, gt=0, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator; the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Names of the LLM's linear modules that get LoRA adapters.",
    )


class LLMConfig(_Section):
    path: str | None = Field(None, description="Local directory of a causal LM (e.g. models/Qwen2.5-0.5B-Instruct).")
    config: dict[str, Any] | None = Field(None, description="Qwen2 config dict for a random-init LLM (tiny default).")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the LLM path, or the synthetic set's tokenizer.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    gradient_checkpointing: bool | Literal["auto"] = Field(
        False,
        description="Trade compute for activation memory in the LLM; auto: on only where the estimate says the "
        "micro-batch needs it (docs/SCALING.md).",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel.")

    @model_validator(mode="after")
    def _one_source(self) -> LLMConfig:
        if (self.path is None) == (self.config is None):
            raise ValueError("set exactly one of path or config")
        return self

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _switch_or_auto(cls, value: Any) -> Any:
        if value != AUTO and not isinstance(value, bool):
            raise ValueError("give true, false or auto")
        return value

    @property
    def checkpointing(self) -> bool:
        """gradient_checkpointing as a choice made: ``auto`` is decided at start, before the model is built."""
        if isinstance(self.gradient_checkpointing, bool):
            return self.gradient_checkpointing
        raise AutoUnresolvedError("model.llm.gradient_checkpointing")


class ModelConfig(_Section):
    llm: LLMConfig = Field(default_factory=lambda: LLMConfig(config={}))
    image_encoder: EncoderConfig = Field(default_factory=lambda: EncoderConfig(enabled=False))
    audio_encoder: EncoderConfig = Field(default_factory=lambda: EncoderConfig(enabled=False))
    aligner_checkpoint: str | None = Field(None, description="Frozen Phase 1 aligner (.pt); none: projectors read encoders.")
    aligner_dim: int = Field(256, gt=0, description="Width of the aligner's shared space.")
    prefix_tokens: int = Field(4, gt=0, description="Prefix embeddings per modality fed to the LLM.")
    projector_hidden: int = Field(256, gt=0, description="Hidden width of each projector MLP.")
    projector: Literal["tokens", "pooled"] = Field(
        "tokens",
        description="tokens: the encoder's tokens pooled to prefix_tokens, one MLP per token; pooled: one mean vector "
        "to all prefix tokens (runs made before 2026-11-26).",
    )


class SyntheticConfig(_Section):
    num_train: int = Field(512, gt=0, description="Training samples generated.")
    num_val: int = Field(64, gt=0, description="Validation samples generated.")
    seed: int = Field(0, description="The set is a pure function of this seed.")
    image_size: int = Field(32, gt=7, description="Side of the generated PNGs in pixels.")


class FieldsConfig(_Section):
    """Where each part of a sample is in another format's files (docs/DATA.md): the first name found wins."""

    image: list[str] = Field(
        default_factory=lambda: ["jpg", "jpeg", "png", "webp", "image"], description="Tar extensions / columns of the picture."
    )
    audio: list[str] = Field(
        default_factory=lambda: ["flac", "wav", "mp3", "ogg", "audio"], description="Tar extensions / Parquet columns of the audio."
    )
    caption: list[str] = Field(
        default_factory=lambda: ["txt", "caption", "text"], description="Tar extensions / JSON keys / columns of a caption."
    )
    conversations: list[str] = Field(
        default_factory=lambda: ["conversations", "messages"], description="JSON keys / columns holding a list of turns."
    )
    prompt: str = Field("prompt", description="JSON key / column of a single-turn prompt.")
    response: str = Field("response", description="JSON key / column of a single-turn response.")
    id: str = Field("id", description="JSON key / column of the sample id (absent: FILE:ROW, or the tar key).")


class DataConfig(_Section):
    train_index: str = Field(
        "data/synthetic/train.jsonl",
        description="Index file, or a glob of shards (brace ranges too: shards/{00000..00999}.tar); formats in docs/DATA.md.",
    )
    val_index: str | None = Field("data/synthetic/val.jsonl", description="Validation index or glob; none: no validation.")
    format: Literal["auto", "purrsight", "llava", "messages", "webdataset", "parquet"] = Field(
        "auto", description="The indexes' format; auto: told from the files (extension, first record)."
    )
    caption_prompt: str = Field(
        "Describe this.", min_length=1, description="The prompt a caption-only sample (a .txt, a caption column) answers."
    )
    media_root: str | None = Field(None, description="Media paths in the indexes are relative to this; none: each index's folder.")
    fields: FieldsConfig = Field(default_factory=FieldsConfig)
    prepared: str | None = Field(
        None,
        description="A prepared set (python train_phase2.py prepare): train from it; none: decode the indexes' files.",
    )
    synthetic_dir: str | None = Field("data/synthetic", description="Generate the synthetic set here when absent; none: never.")
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    max_length: int = Field(64, gt=0, description="Text tokens per sample (prompt + response), truncated beyond.")
    image_size: int = Field(32, gt=0, description="Resize side for the tiny default's fixed image transform.")
    max_image_pixels: int = Field(
        250_000_000, gt=0, description="Larger pictures are refused from their header (a bad sample); 200-MP phone photos fit."
    )
    image_background: list[int] = Field(
        default_factory=lambda: [255, 255, 255],
        min_length=3,
        max_length=3,
        description="RGB that transparent pixels are composited onto.",
    )
    audio_sample_rate: int = Field(16000, gt=0, description="Sample rate the audio encoder expects.")
    audio_seconds: float = Field(0.25, gt=0, description="Clips are cropped or zero-padded to this length.")
    resample: bool = Field(True, description="Resample audio at another rate (true) or refuse it (false).")
    on_bad_sample: Literal["error", "skip"] = Field("error", description="A sample that fails to decode: stop, or skip and count.")
    max_bad_samples: int = Field(16, ge=0, description="With skip: more skipped samples than this stops the run.")
    max_consecutive_bad_samples: int = Field(
        8, gt=0, description="With skip: this many bad samples in a row (a broken folder, not a bad file) stops the run."
    )
    batch_size: int | Literal["auto"] = Field(
        8,
        description="Samples per process per micro-batch; auto: the largest the device's memory holds by the estimate, "
        "up to trainer.global_batch_size's share (docs/SCALING.md).",
    )
    pad_to_multiple_of: int | None = Field(
        None,
        gt=0,
        description="Pad each batch's text to a multiple of this many tokens (at most data.max_length): a few shapes, "
        "so trainer.compile compiles each once, statically, instead of recompiling for every length; the padded "
        "positions cost compute; none: to the batch's longest.",
    )
    group_by_length: bool = Field(
        False, description="Batch samples of similar length together, in shuffled groups within windows (docs/DATA.md)."
    )
    length_group_size: int = Field(
        256, gt=0, description="Samples per length group; a multiple of batch_size x processes keeps micro-batches in one group."
    )
    length_group_window: int = Field(64, gt=0, description="Groups sorted by length together; their order is shuffled.")
    on_data_change: Literal["refuse", "next_epoch"] = Field(
        "refuse",
        description="A resume whose training set (size, content), run.seed or length grouping differs from its "
        "checkpoint's: refuse, naming what differs, or start the next epoch at sample 0 on the set as it is now.",
    )
    num_workers: int = Field(0, ge=0, description="Loader worker processes per rank; 0 decodes in the training process.")
    pin_memory: bool | Literal["auto"] = Field("auto", description="Pinned host memory; auto: on when training on GPUs.")

    @property
    def micro_batch(self) -> int:
        """batch_size as a number: ``auto`` is decided at start (training/auto_settings.py), before anything reads it."""
        if isinstance(self.batch_size, int):
            return self.batch_size
        raise AutoUnresolvedError("data.batch_size")

    @field_validator("batch_size", mode="before")
    @classmethod
    def _samples_or_auto(cls, value: Any) -> Any:
        # One problem a bad value, not one for each of the union's members.
        if value != AUTO and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError("Input should be greater than 0 (a whole number of samples), or auto")
        return value

    @field_validator("image_background")
    @classmethod
    def _rgb(cls, value: list[int]) -> list[int]:
        if not all(0 <= channel <= 255 for channel in value):
            raise ValueError(f"each of red, green, blue must lie in 0..255, got {value}")
        return value


class OptimConfig(_Section):
    lr: float = Field(2e-3, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], min_length=2, max_length=2, description="AdamW betas.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup from 0 to lr, in optimizer steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of lr.")

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must each lie in [0, 1), got {self.betas}")
        return self


class TrainerConfig(_Section):
    max_steps: int = Field(150, gt=0, description="Optimizer steps to train.")
    accumulate_grad_batches: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    global_batch_size: int | None = Field(
        None,
        gt=0,
        description=(
            "Samples per optimizer step, kept when the number of processes changes (an elastic job): each start "
            "sets accumulate_grad_batches to global / (processes x data.batch_size), or the nearest; none: off."
        ),
    )
    gradient_clip_val: float | None = Field(1.0, description="Clip the global grad norm; none: no clipping.")
    precision: Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true"] = Field(
        "auto", description="auto: bf16-mixed on GPUs that support it, 32-true otherwise."
    )
    accelerator: Literal["auto", "cpu", "gpu"] = Field("auto", description="auto: gpu when CUDA is available.")
    compile: bool = Field(
        False,
        description="torch.compile the decoder layers, projectors and loss: slower first steps (compilation), faster after.",
    )
    cuda_graphs: bool = Field(
        False,
        description=(
            "Replay the compiled decoder layers as CUDA graphs (torch.compile's reduce-overhead): one launch a layer "
            "instead of its kernels; needs trainer.compile and data.pad_to_multiple_of (static shapes); GPUs only."
        ),
    )
    val_every_n_steps: int = Field(50, gt=0, description="Validate every N optimizer steps and at the end.")
    limit_val_batches: int | None = Field(None, description="Cap validation batches; none: the whole set.")


class CheckpointConfig(_Section):
    every_n_steps: int = Field(50, gt=0, description="Save every N optimizer steps (and at the end).")
    keep_last: int = Field(3, gt=0, description="Newest step checkpoints kept; last.ckpt is kept besides.")


class DistributedConfig(_Section):
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: the whole model on every rank; fsdp: frozen weights sharded over all ranks (a base larger than one GPU).",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on GPUs, gloo on CPU.")
    timeout_s: int = Field(600, gt=0, description="Process-group timeout for a collective that never completes.")
    bucket_cap_mb: int = Field(25, gt=0, description="DDP gradient bucket size.")
    gradient_as_bucket_view: bool = Field(True, description="Gradients alias DDP buckets: saves one copy of them.")
    static_graph: bool = Field(False, description="DDP static graph; every step uses the same parameters.")
    find_unused_parameters: bool = Field(False, description="Not needed: every trainable parameter is used each step.")
    broadcast_buffers: bool = Field(
        False, description="DDP re-sends rank 0's buffers every forward; none of this model's buffers change in training."
    )
    progress_timeout_s: int | None = Field(
        1800, gt=0, description="No finished step for this long: dump every thread's stack and exit; none: off."
    )


class PreflightConfig(_Section):
    mode: Literal["off", "quick", "full"] = Field("quick", description="All-reduce check before training.")
    min_busbw_gbps: float | None = Field(
        None, ge=0, description="Fail the job when bus bandwidth is below this; none: report only."
    )
    straggler_factor: float = Field(2.0, gt=1, description="Name a rank whose local work takes this many times the median.")

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false: `mode: off` must still mean "off".
        return "off" if value is False else value


class TelemetryConfig(_Section):
    enabled: bool = Field(True, description="Sample power, host and throughput every N steps into telemetry/node<N>.csv.")
    every_n_steps: int = Field(10, gt=0, description="Optimizer steps between samples.")
    barrier_every: int | None = Field(None, gt=0, description="Barrier every N optimizer steps for clean power traces.")
    peak_tflops: float | None = Field(None, gt=0, description="GPU peak for MFU; none: A100/H100/H200 bf16 table.")


class ProfilerConfig(_Section):
    enabled: bool = Field(False, description="Record a torch.profiler trace (Chrome format) per rank.")
    start_step: int = Field(5, ge=0, description="First optimizer step recorded (after warm-up).")
    end_step: int = Field(8, gt=0, description="Recording stops after this optimizer step.")

    @model_validator(mode="after")
    def _window(self) -> ProfilerConfig:
        if self.end_step <= self.start_step:
            raise ValueError(f"end_step {self.end_step} must be after start_step {self.start_step}")
        return self


class LoggingConfig(_Section):
    csv: bool = Field(True, description="CSV metrics in the run folder.")
    tensorboard: bool = Field(False, description="TensorBoard event files too (needs the tensorboard package).")
    every_n_steps: int = Field(10, gt=0, description="Metrics and progress lines every N optimizer steps.")
    progress: Literal["auto", "bar", "lines"] = Field("auto", description="auto: a bar on a terminal, lines in a log file.")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking server (http://host:5000) or store URI; one MLflow run per run folder (needs .[mlflow])."
    )
    mlflow_experiment: str = Field("purrsight", min_length=1, description="MLflow experiment the run is logged under.")
    wandb_project: str | None = Field(None, description="Weights & Biases project; one W&B run per run folder (needs .[wandb]).")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: files in the run folder, uploaded later with `wandb sync`; online: sent as it trains."
    )


def _worker_range(count: int | list[int]) -> tuple[int, int]:
    return (count, count) if isinstance(count, int) else (count[0], count[1])


class RayConfig(_Section):
    """Only read by ``--engine ray`` (purrsight/ray_engine): the Ray cluster runs the workers."""

    num_workers: int | list[int] = Field(
        2,
        description="Training processes (Ray Train workers), one per GPU on GPU clusters; [MIN, MAX]: elastic, the group "
        "starts with what the cluster fits up to MAX and goes on with at least MIN when a node is lost.",
    )
    resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0}, description='Ray resources each worker reserves, e.g. {"GPU": 1, "CPU": 8}.'
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How Ray places the workers: PACK fills a node before the next."
    )
    max_failures: int = Field(
        3, ge=-1, description="Worker-group restarts after a failure (resume from the newest checkpoint); -1: no limit."
    )
    shared_dir: str | None = Field(
        None,
        description="Storage every Ray node mounts; relative paths in the config are taken from it (none: the driver's folder).",
    )

    @field_validator("num_workers")
    @classmethod
    def _worker_count(cls, value: int | list[int]) -> int | list[int]:
        if not isinstance(value, int) and len(value) != 2:
            raise ValueError(f"{value}: a count, or [MIN, MAX] for an elastic group")
        low, high = _worker_range(value)
        if not 1 <= low <= high:
            raise ValueError(f"{value}: at least 1 worker, and MIN no more than MAX")
        return value

    @property
    def worker_range(self) -> tuple[int, int]:
        """(MIN, MAX) workers: equal for a fixed count."""
        return _worker_range(self.num_workers)

    @field_validator("resources_per_worker")
    @classmethod
    def _positive_resources(cls, value: dict[str, float]) -> dict[str, float]:
        bad = [name for name, amount in value.items() if amount < 0]
        if bad:
            raise ValueError(f"negative amount for {', '.join(bad)}")
        return value


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    # The keys this command's overrides set (section.key), as load_config read them: what the user
    # said for this run, as against the config file's standing values (a prepared set's check).
    _overridden: frozenset[str] = PrivateAttr(default=frozenset())
    # The settings the start chose because they said auto (training/auto_settings.py): a
    # checkpoint records them, so a resume knows its run's own choices from values it was given.
    _auto_chosen: frozenset[str] = PrivateAttr(default=frozenset())

    @property
    def overridden(self) -> frozenset[str]:
        return self._overridden

    @property
    def auto_chosen(self) -> frozenset[str]:
        return self._auto_chosen

    @property
    def left_auto(self) -> list[str]:
        """The settings (dotted) this config leaves ``auto``, for the start to choose (training/auto_settings.py)."""
        values = {
            "data.batch_size": self.data.batch_size,
            "model.llm.gradient_checkpointing": self.model.llm.gradient_checkpointing,
        }
        return [key for key, value in values.items() if value == AUTO]

    def with_auto_chosen(self, keys: list[str]) -> Config:
        """This config, recording that ``keys`` (dotted) were chosen at start, not given."""
        copy = self.model_copy()
        copy._auto_chosen = frozenset(keys)
        return copy

    def __eq__(self, other: object) -> bool:
        """The settings alike: where each came from (``overridden``) is no part of a config's value."""
        if not isinstance(other, Config):
            return NotImplemented
        return self.__dict__ == other.__dict__

    @model_validator(mode="after")
    def _sharding_compiles_nothing(self) -> Config:
        if self.distributed.strategy == "fsdp" and self.trainer.compile:
            raise ValueError("trainer.compile is not supported with distributed.strategy=fsdp; set trainer.compile=false")
        return self

    @model_validator(mode="after")
    def _cuda_graphs_replay_static_compiled_shapes(self) -> Config:
        # A graph is recorded per input shape and replayed as recorded: compiled, and few shapes.
        if self.trainer.cuda_graphs and not (self.trainer.compile and self.data.pad_to_multiple_of):
            raise ValueError(
                "trainer.cuda_graphs replays compiled layers at static shapes: set trainer.compile=true and "
                "data.pad_to_multiple_of (e.g. 128), or trainer.cuda_graphs=false"
            )
        # The accumulation a global batch implies is known at the start (training/run.py refuses it there).
        if self.trainer.cuda_graphs and self.trainer.global_batch_size is None and self.trainer.accumulate_grad_batches > 1:
            raise ValueError(
                "trainer.cuda_graphs needs one micro-batch per optimizer step (a replay overwrites the last one's "
                "gradients); set trainer.accumulate_grad_batches=1 or trainer.cuda_graphs=false"
            )
        return self

    @model_validator(mode="after")
    def _auto_batch_fills_a_global_batch(self) -> Config:
        # The samples an optimizer step averages over are the user's to choose, not the GPU's.
        if self.data.batch_size == AUTO and self.trainer.global_batch_size is None:
            raise ValueError(
                "data.batch_size=auto needs trainer.global_batch_size (samples per optimizer step) to fill; "
                "set it, or give data.batch_size a number"
            )
        return self

    @model_validator(mode="after")
    def _sharding_takes_no_fp16_mixed(self) -> Config:
        # Lightning's ModelParallelStrategy (our fsdp) refuses it at the trainer's build, after the job started.
        if self.distributed.strategy == "fsdp" and self.trainer.precision == "16-mixed":
            raise ValueError(
                "trainer.precision=16-mixed is not supported with distributed.strategy=fsdp; use bf16-mixed (or 32-true)"
            )
        return self

    def tokenizer_dir(self) -> Path:
        """model.llm.tokenizer, else the LLM directory, else the synthetic set's tokenizer."""
        llm = self.model.llm
        chosen = llm.tokenizer or llm.path or (self.data.synthetic_dir and f"{self.data.synthetic_dir}/tokenizer")
        if chosen is None:
            raise ConfigError(
                ["model.llm.tokenizer: required when the LLM is built from a config dict and data.synthetic_dir is unset"]
            )
        return Path(chosen)


# --------------------------------------------------------------------------- loading


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """``a.b=value`` -> (["a", "b"], value); the value is parsed as YAML so types survive."""
    parsed, problems = [], []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"override {item!r}: expected section.key=value")
            continue
        try:
            value = safe_yaml_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw  # an unparsable value stays a string; the schema judges it
        parsed.append((key.split("."), value))
    if problems:
        raise ConfigError(problems)
    return parsed


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted key in a nested dict; the schema later judges names and types."""
    for keys, value in parse_overrides(overrides):
        node = data
        for part in keys[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[keys[-1]] = value
    return data


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError([f"{path}: config file not found"]) from None
    except OSError as err:
        raise ConfigError([f"{path}: cannot read config file ({err.strerror})"]) from None
    try:
        data = safe_yaml_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise ConfigError([f"{path}:{where}: YAML syntax error: {problem}"]) from None
    if data is None:  # an empty file would silently train the built-in defaults
        raise ConfigError([f"{path}: the config file is empty (copy config/train_config.yaml and edit it)"])
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections"])
    return data


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The schema class that owns the field at ``loc`` (for did-you-mean suggestions)."""
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _source_of(dotted: str, path: Path, overrides: list[str]) -> str:
    """Who set the key at ``dotted``: the last override naming it (or a part of it), else the file."""
    for item in reversed(overrides):
        key = item.partition("=")[0]
        if dotted == key or dotted.startswith(f"{key}.") or key.startswith(f"{dotted}."):
            return f"override {item}"
    return str(path)


def _describe(error: Any, path: Path, overrides: list[str]) -> str:
    loc = tuple(error["loc"])
    dotted = ".".join(str(p) for p in loc)
    source = _source_of(dotted, path, overrides)
    if error["type"] == "extra_forbidden":
        owner = _model_at(loc[:-1])
        hint = ""
        if owner is not None:
            close = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1)
            known = ", ".join(owner.model_fields)
            hint = f"; did you mean {'.'.join(map(str, (*loc[:-1], close[0])))}?" if close else f"; known keys: {known}"
        return f"{source}: unknown key {dotted}{hint}"
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if not loc:  # a rule across sections: the override of a key it names, where one set it
        sources = [_source_of(key, path, overrides) for key in re.findall(r"[a-z_]+(?:\.[a-z_]+)+", message)]
        source = next((found for found in sources if found != str(path)), source)
    got = error.get("input")
    shown = "" if error["type"] == "missing" or isinstance(got, dict) else f" (got {got!r})"
    return f"{source}: {dotted or 'config'}: {message}{shown}"


def path_problems(config: Config, source: str, overrides: list[str] | None = None) -> list[str]:
    """Local model files and index files must exist: nothing is ever downloaded at run time.

    Each problem names its origin: ``source`` (the config file) or the override that set it.
    """

    def origin(key: str) -> str:
        return _source_of(key, Path(source), list(overrides or []))

    problems = []
    candidates = {
        "model.llm.path": config.model.llm.path,
        "model.llm.tokenizer": config.model.llm.tokenizer,
        "model.image_encoder.path": config.model.image_encoder.path if config.model.image_encoder.enabled else None,
        "model.audio_encoder.path": config.model.audio_encoder.path if config.model.audio_encoder.enabled else None,
        "model.aligner_checkpoint": config.model.aligner_checkpoint,
    }
    for key, value in candidates.items():
        if value is not None and not Path(value).exists():
            problems.append(
                f"{origin(key)}: {key}: path {value} does not exist (models are never downloaded; point it at a local copy)"
            )
    # With a synthetic_dir the set is generated on first use, so its own two indexes may be
    # missing yet; any other index must exist already.
    synthetic = config.data.synthetic_dir
    generated = {Path(synthetic) / "train.jsonl", Path(synthetic) / "val.jsonl"} if synthetic is not None else set()
    for key, value in {"data.train_index": config.data.train_index, "data.val_index": config.data.val_index}.items():
        if value is None or Path(value).is_file() or Path(value) in generated:
            continue
        if config.data.prepared is not None:
            continue  # a prepared set trains alone: its sources need not be here (prepared_manifest.check_sources)
        if any(mark in value for mark in "*?[{"):  # a glob or brace range of shards: its reader names a missing file
            continue
        note = f" (the synthetic set is generated as {synthetic}/train.jsonl and val.jsonl)" if synthetic is not None else ""
        problems.append(f"{origin(key)}: {key}: index file {value} does not exist{note}")
    return problems


PATH_KEYS = (
    "run.output_dir",
    "data.train_index",
    "data.val_index",
    "data.prepared",
    "data.synthetic_dir",
    "data.media_root",
    "model.llm.path",
    "model.llm.tokenizer",
    "model.image_encoder.path",
    "model.audio_encoder.path",
    "model.aligner_checkpoint",
)


def with_paths_under(config: Config, base: Path) -> Config:
    """The config with every relative path in PATH_KEYS made absolute under ``base``.

    For engines whose processes do not share the caller's working folder (Ray runs each
    worker in its own copy of the job's working dir): one absolute meaning on every node.
    """
    data = config.model_dump(mode="json")
    for dotted in PATH_KEYS:
        *parents, key = dotted.split(".")
        node = data
        for part in parents:
            node = node[part]
        value = node[key]
        if value is not None and not Path(value).is_absolute():
            node[key] = str(base / value)
    return Config.model_validate(data)


def load_config(path: str | Path, overrides: list[str] | None = None, check_paths: bool = True) -> Config:
    """Read, override, validate. Raises ConfigError listing every problem."""
    path, overrides = Path(path), list(overrides or [])
    data = apply_overrides(read_yaml(path), overrides)
    try:
        config = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError([_describe(e, path, overrides) for e in err.errors()]) from None
    problems = path_problems(config, str(path), overrides) if check_paths else []
    if problems:
        raise ConfigError(problems)
    config._overridden = frozenset(override.split("=", 1)[0].strip() for override in overrides)
    return config


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def write_resolved(config: Config, folder: Path) -> Path:
    """The config actually used, beside the checkpoints, so a run can be reproduced."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "resolved_config.yaml"
    write_text_atomically(target, dump_config(config))
    return target


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or argv[0] != "check" or len(argv) < 2:
        print(
            "usage: python -m purrsight.config check CONFIG.yaml [section.key=value ...]\n"
            "Validates the config with its overrides: names, types and ranges, and that the local model,\n"
            "tokenizer and index paths exist (relative to this folder; a synthetic set's own indexes are\n"
            "generated on first use). It does not open data or model files. Exit 0 when valid, 2 with one\n"
            "line per problem."
        )
        return 0 if argv and argv[0] in {"-h", "--help"} else ExitCode.USAGE
    try:
        load_config(argv[1], argv[2:])
    except ConfigError as err:
        err.print_problems()
        return ExitCode.USAGE
    print(f"config OK: {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
