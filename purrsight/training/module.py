"""The LightningModule: loss, metrics, optimiser and schedule, checkpoint contents."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.types import OptimizerLRSchedulerConfig

from purrsight.config import Config, dump_config
from purrsight.data.media import SampleError
from purrsight.distributed.process_group import computed_on_rank_zero
from purrsight.errors import UserError
from purrsight.model.llm import leave_lora_casts_to_autocast
from purrsight.model.lora_compute_copies import AdapterComputeCopies, use_adapter_compute_copies
from purrsight.model.multimodal import PurrSightModel
from purrsight.runs.checkpoint_files import AUTO_CHOSEN_KEY
from purrsight.runs.checkpoint_saver import validation_cut_by_stop
from purrsight.runs.data_order import ORDER_KEY
from purrsight.runs.data_position import POSITION_KEY
from purrsight.training.datamodule import Phase2DataModule
from purrsight.training.fingerprint import FINGERPRINT_VERSION
from purrsight.training.fsdp import build_sharded, local_frozen_bytes, peak_rss_bytes
from purrsight.training.model_builder import build_model, compile_trainable_path, fingerprint_v2, frozen_dtype, padded_shapes
from purrsight.training.optim import build_optimizer, continue_schedule

CHECKPOINT_META_KEY = "purrsight"
log = logging.getLogger(__name__)


class CheckpointMismatchError(UserError):
    """A checkpoint made for another model; the message names the difference."""


class Phase2Module(pl.LightningModule):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.model: PurrSightModel | None = None  # built in configure_model, after the data is prepared
        self.fingerprint = ""
        self._fingerprints_then: dict[int, str] = {}  # earlier versions computed at the build (version 3)
        self.skipped_samples = 0
        self._validation_sums = torch.zeros(3, dtype=torch.float64)
        self._adapter_copies: AdapterComputeCopies | None = None  # eager ddp under a mixed precision
        # Checkpoints hold trainable weights only; frozen ones are rebuilt from their source.
        self.strict_loading = False

    def configure_model(self) -> None:
        if self.model is None:
            # Under bf16 precision the frozen weights are stored in bf16 (half the memory, no
            # re-cast by autocast in every forward); used without a trainer, float32.
            precision = str(self._trainer.precision) if self._trainer is not None else "32-true"
            dtype = frozen_dtype(precision)
            if self.config.distributed.strategy == "fsdp" and self._device_mesh is not None:
                built, units = build_sharded(
                    self.config, dtype, self._device_mesh["data_parallel"], self.trainer.strategy.root_device, precision
                )
                how = f"sharded over {self._device_mesh.size()} ranks in {units} FSDP units"
            else:
                # Every rank hashes its share of the frozen rows for the fingerprint (fingerprint.py).
                everyone = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
                built, how = build_model(self.config, dtype, fingerprint_group=everyone), "whole"
                if not self.config.trainer.compile:
                    # Not under fsdp, whose all-gather hands the layers bf16 weights, nor compiled,
                    # where the casts are graph ops: model/lora_compute_copies.py.
                    self._adapter_copies = use_adapter_compute_copies(built.model, precision)
                    if self._adapter_copies is not None:
                        log.info(
                            "LoRA: %d adapter matrices cast to %s once a decoder layer a micro-batch (%d layers), not at each use",
                            self._adapter_copies.count,
                            "bf16" if precision.startswith("bf16") else "fp16",
                            len(self._adapter_copies.groups),
                        )
            # Before compiling: the layers' code reads the switch (model/llm.py says why).
            leave_lora_casts_to_autocast(built.model, precision)
            if self.config.trainer.compile:
                shapes = padded_shapes(self.config)
                graphs = self.config.trainer.cuda_graphs
                layers = compile_trainable_path(built.model, shapes, cuda_graphs=graphs)
                compiled = f"static, at most {shapes} shapes (data.pad_to_multiple_of)" if shapes else "dynamic shapes"
                if graphs:  # inductor records graphs for CUDA tensors only
                    on_gpu = self._trainer is not None and self.trainer.strategy.root_device.type == "cuda"
                    compiled += "; the layers replayed as CUDA graphs" if on_gpu else "; no CUDA device, so no CUDA graphs"
                log.info(
                    "trainer.compile: %d LLM decoder layers, the projectors and the loss compiled "
                    "(%s; the first steps include compilation)",
                    layers,
                    compiled,
                )
            log.info(
                "model built: frozen weights %s; this rank holds %.2f MiB of them; peak RSS so far %.0f MiB",
                how,
                local_frozen_bytes(built.model) / 2**20,
                peak_rss_bytes() / 2**20,
            )
            self.model, self.fingerprint = built.model, built.fingerprint
            self._fingerprints_then = built.earlier_fingerprints

    # ------------------------------------------------------------------ steps

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The RNG stream (LoRA dropout and the like) is a pure function of seed, position
        # and rank, so a resumed run draws the same numbers as an uninterrupted one
        # without storing RNG state in checkpoints.
        key = f"{self.config.run.seed}:{self.current_epoch}:{batch_idx}:{self.global_rank}"
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1
        # Only the generators this process draws from: torch.manual_seed also queues a lazy
        # seeding of every other backend (XPU, ...), formatting a stack trace each time
        # (1.4% of a tiny-model step, bench/results/launch.md).
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)  # this process's GPU; CUDA is initialised by now
        datamodule = self._datamodule()
        if datamodule is not None:
            datamodule.count_trained_batch(self.current_epoch)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        self.skipped_samples += int(batch["num_skipped"])
        if self.skipped_samples > self.config.data.max_bad_samples:
            raise SampleError(  # bad data, not a bug: one line and exit 2, as for any bad sample
                f"{self.skipped_samples} bad samples skipped on rank {self.global_rank}, "
                f"above data.max_bad_samples={self.config.data.max_bad_samples}; fix the data or raise the cap"
            )
        self._new_graph_step()
        self._refresh_adapter_copies()
        loss = self.model(batch).loss
        size = batch["input_ids"].shape[0]
        # Only on the steps the loggers and the progress line write: every self.log call
        # costs about a millisecond of Lightning bookkeeping (bench/results/launch.md). Not prog_bar:
        # Lightning turns progress-bar metrics into numbers at every step's end, which on a
        # GPU makes the host wait for the device each step (our bars read callback_metrics).
        if (self.trainer.global_step + 1) % self.config.logging.every_n_steps == 0:
            self.log("train/loss", loss, on_step=True, batch_size=size)
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, batch_size=size)
        if batch["num_skipped"]:
            self.log("train/skipped_samples", float(self.skipped_samples), on_step=True, batch_size=size)
        return loss

    def _new_graph_step(self) -> None:
        """With trainer.cuda_graphs, marks a new iteration for torch's CUDA graph trees at each
        micro-batch: the last one's outputs (its backward done) may then be overwritten by the next
        replay. Torch starts one by itself at a compiled call with no backward pending, which holds
        for training's forward-backward but not around validation's forwards
        (``torch.compiler.cudagraph_mark_step_begin``'s documentation)."""
        if self.config.trainer.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def _refresh_adapter_copies(self) -> None:
        if self._adapter_copies is not None:
            self._adapter_copies.refresh(self.device.type)  # under the precision's autocast, as the forward

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The micro-batch's backward (its recomputation read the copies) and optimizer step are done.
        if self._adapter_copies is not None:
            self._adapter_copies.release()

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._adapter_copies is not None:
            self._adapter_copies.release()

    def on_validation_epoch_start(self) -> None:
        self._validation_sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss x samples, correct, samples

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        assert self.model is not None
        self._new_graph_step()
        self._refresh_adapter_copies()
        loss, right = self.model(batch, accuracy=True)
        assert right is not None
        size = batch["input_ids"].shape[0]
        # Summed here and reduced once at the pass's end (on the device: no step waits for a value),
        # so a pass cut short by a stop can be left unlogged (Lightning logs what self.log collected).
        correct = right.sum()
        self._validation_sums += torch.stack([loss.detach().double() * size, correct.double(), loss.new_tensor(size).double()])

    def on_validation_epoch_end(self) -> None:
        if validation_cut_by_stop(self.trainer):
            return  # every rank cut the pass at the same batch: none reduces, none logs
        sums = self.trainer.strategy.reduce(self._validation_sums, reduce_op="sum")
        # Equal on every rank already; sync_dist's mean of equal values changes nothing and keeps
        # Lightning from warning that an epoch-level value was logged unsynced (numbers too: it
        # makes them tensors). Two scalar all-reduces a pass.
        self.log("val/loss", (sums[0] / sums[2]).float(), sync_dist=True)
        self.log("val/accuracy", (sums[1] / sums[2]).float(), sync_dist=True)

    # ------------------------------------------------------------------ optimiser

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        assert self.model is not None
        # The one precision with a grad scaler (no trainer: the module used alone, unscaled).
        scaled = self._trainer is not None and self._trainer.precision == "16-mixed"
        trainable, steps = self.model.trainable_parameters(), self.config.trainer.max_steps
        optimizer, scheduler = build_optimizer(trainable, self.config.optim, steps, scaled_gradients=scaled)
        if self._adapter_copies is not None:  # weights that change end any copies of them (an exception skips release)
            optimizer.register_step_post_hook(self._adapter_copies.release)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's mixed-precision plugin refuses to clip for an optimizer that unscales in its
        own step (the fused AdamW of GPUs), for fear of a grad scaler's scaled gradients. Only
        16-mixed scales, and it gets no fused step (build_optimizer); under bf16-mixed the
        gradients are true ones, so they are clipped here as Lightning's plain precision clips
        them (every bf16 run on a GPU stopped at its first step with the default clip of 1.0)."""
        if self.trainer.precision == "16-mixed" or not gradient_clip_val:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(parameters, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(parameters, gradient_clip_val)

    # ------------------------------------------------------------------ checkpoints

    def trainable_shapes(self) -> dict[str, list[int]]:
        assert self.model is not None
        return {f"model.{n}": list(p.shape) for n, p in self.model.named_parameters() if p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        keep = self.trainable_shapes()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        checkpoint[CHECKPOINT_META_KEY] = {
            "fingerprint": self.fingerprint,
            "fingerprint_version": FINGERPRINT_VERSION,
            "projector": self.config.model.projector,
            "trainable_shapes": keep,
            "config": dump_config(self.config),
            AUTO_CHOSEN_KEY: sorted(self.config.auto_chosen),
        }
        datamodule = self._datamodule()
        if datamodule is not None:
            checkpoint[CHECKPOINT_META_KEY][POSITION_KEY] = datamodule.position().as_dict()
            checkpoint[CHECKPOINT_META_KEY][ORDER_KEY] = datamodule.data_order()

    def on_train_start(self) -> None:
        # A resume: the optimizer and its schedule were restored before this hook. A schedule
        # the config now changes is joined to the restored one (no jump in the learning rate).
        if self.trainer.global_step > 0 and self.trainer.lr_scheduler_configs:
            scheduler = self.trainer.lr_scheduler_configs[0].scheduler
            assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
            for line in continue_schedule(scheduler, self.config, self.trainer.global_step):  # every rank joins
                if self.trainer.is_global_zero:
                    log.info("resumed with another schedule: %s", line)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        shapes, projector = self.trainable_shapes(), self.config.model.projector
        verify_checkpoint(checkpoint, self.fingerprint, shapes, projector, self._earlier_fingerprint)
        datamodule = self._datamodule()
        if datamodule is not None:
            datamodule.resume_from(checkpoint)

    def _earlier_fingerprint(self, version: int) -> str | None:
        """This model's fingerprint as an earlier ``version`` computed it; None for one never computable
        here. Version 3 was computed at the build; version 2 (a strided read of most frozen pages)
        runs now, on rank 0 alone, broadcast."""
        if version in self._fingerprints_then:
            return self._fingerprints_then[version]
        if version != 2:
            return None
        log.info(
            "the checkpoint's fingerprint is version 2: computing that version once to check it (saves write %d)",
            FINGERPRINT_VERSION,
        )
        everyone = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        return computed_on_rank_zero(lambda: fingerprint_v2(self.config), everyone)

    def _datamodule(self) -> Phase2DataModule | None:
        """The fit's DataModule (set by fit(); absent when the module is used alone)."""
        datamodule = getattr(self._trainer, "datamodule", None)
        return datamodule if isinstance(datamodule, Phase2DataModule) else None


PROJECTOR_NAMES = {
    "tokens": "tokens projector (encoder tokens pooled to model.prefix_tokens)",
    "pooled": "pooled projector (one mean vector to every prefix token)",
}


def verify_checkpoint(
    checkpoint: dict[str, Any],
    fingerprint: str,
    shapes: dict[str, list[int]],
    projector: str,
    earlier: Callable[[int], str | None] = lambda version: None,
) -> None:
    """Refuse a checkpoint whose projector, frozen sources or trainable shapes differ from this model.

    ``fingerprint`` is this model's, of FINGERPRINT_VERSION; ``earlier(version)`` gives it as an
    earlier version computed it, asked only for a checkpoint saved with that version (None: never
    computable here)."""
    meta = checkpoint.get(CHECKPOINT_META_KEY)
    if not isinstance(meta, dict):
        raise CheckpointMismatchError("not a PurrSight Phase 2 checkpoint (no 'purrsight' section)")
    saved_projector = meta.get("projector", "pooled")  # checkpoints before the key all hold the pooled one
    if saved_projector != projector:
        raise CheckpointMismatchError(
            f"the checkpoint holds the {PROJECTOR_NAMES.get(saved_projector, saved_projector)}; this config builds the "
            f"{PROJECTOR_NAMES.get(projector, projector)}: set model.projector={saved_projector} to resume it"
        )
    version = meta.get("fingerprint_version")
    if meta.get("fingerprint") != fingerprint and version is None:
        # Saved before version 2, whose fingerprint included the model folders' absolute
        # paths: it cannot be recomputed here, and refusing would strand every such run.
        log.warning(
            "checkpoint saved by an earlier PurrSight: its frozen-source fingerprint (path-bound) cannot be "
            "checked; the trainable shapes are"
        )
    elif version is not None:
        expected = fingerprint if version == FINGERPRINT_VERSION else earlier(int(version))
        if expected is None and version == 2:
            # Every caller here passes a version-2 ``earlier``; one that does not is a bug, not the checkpoint's fault.
            raise CheckpointMismatchError(
                "the checkpoint's frozen-source fingerprint is version 2, and this check was given no way to compute it"
            )
        if expected is None:
            raise CheckpointMismatchError(
                f"the checkpoint's frozen-source fingerprint is version {version}, which this PurrSight cannot compute "
                f"(it computes {FINGERPRINT_VERSION}, 3 and 2): resume it with the PurrSight that saved it"
            )
        if meta.get("fingerprint") != expected:
            raise CheckpointMismatchError(
                "frozen-source fingerprint differs: the checkpoint was trained on other frozen weights "
                "(LLM, encoders, aligner or their config/seed changed)"
            )
    saved = {k: list(v.shape) for k, v in checkpoint.get("state_dict", {}).items()}
    for key in sorted(set(shapes) | set(saved)):
        if key not in saved:
            raise CheckpointMismatchError(f"trainable parameter {key} is missing from the checkpoint")
        if key not in shapes:
            raise CheckpointMismatchError(f"checkpoint parameter {key} does not exist in this model")
        if saved[key] != shapes[key]:
            raise CheckpointMismatchError(f"{key}: checkpoint shape {saved[key]}, model shape {shapes[key]}")
