"""The engine's API between steps: checkpoints (save_state, load_state, rank_dir), exports
(export_weights, trainable_state_dict), Adam's hyper-parameters per param group (set_hypers,
set_lr, get_lr) and what the engine reports of its budgets and estimates. A mixin of
OffloadEngine (runtime/engine.py).

Note: the seam. engine.py builds the engine and runs its steps (forward, backward, step, the
windows, the aborts, close); what is here runs between steps, on what it built (the units, the
store, the optimizer pipeline, the data-parallel group, the step transaction, the accounting,
the settings, the loss scaler), and never changes how a step runs. Each method that reads or
writes the training state first lets the optimizer finish (`_quiesce`: the last step's pending
updates applied, their writes started), so a checkpoint or an export sees the weights a step
left.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

import offloadpp.runtime.checkpoint as ckpt
import offloadpp.runtime.export as export
from offloadpp.optim import AdamHyper

from .dp.sharded_checkpoint import agreed, load_sharded, rank_dir, save_sharded, verify_sharded
from .unit import TORCH_DTYPES


class BetweenSteps:
    """OffloadEngine's methods between steps (the module's Note); the engine provides units,
    store, optimizer, dp, transaction, accounting, settings, module, hypers, loss_scaler,
    global_step, micro_in_window and _check_open."""

    @property
    def hyper(self) -> AdamHyper:
        """The first param group's hyper-parameters (the only ones without set_hypers)."""
        return self.hypers[0]

    def set_hypers(self, hypers, groups: Optional[dict] = None) -> None:
        """Adam's hyper-parameters per param group, used from the next update on (an update in
        flight keeps the ones it started with). `groups` maps parameter names (any of a tied
        parameter's names) to an index into `hypers`; given, it must place every trainable
        parameter, and it replaces the previous assignment. Without it, the assignment stays
        (at first: every parameter in group 0)."""
        hypers = tuple(hypers)
        if not hypers or not all(isinstance(h, AdamHyper) for h in hypers):
            raise TypeError(f"set_hypers: expected a non-empty sequence of AdamHyper, got {hypers!r}")
        if groups is not None:
            new = []
            for u in self.units:
                idx = []
                for p, s in u.params:
                    g = next((groups[n] for n in s.names if n in groups), None)
                    if g is None and p.requires_grad:
                        raise ValueError(
                            f"set_hypers: parameter {s.name!r} requires grad but is in no param group; "
                            "every trainable parameter is updated (set requires_grad=False to freeze it)"
                        )
                    g = 0 if g is None else g
                    if not isinstance(g, int) or not 0 <= g < len(hypers):
                        raise ValueError(
                            f"set_hypers: parameter {s.name!r}: group {g!r} is not in 0..{len(hypers) - 1}"
                        )
                    idx.append(g)
                new.append(idx)
            for u, idx in zip(self.units, new):
                u.groups = idx
        elif any(g >= len(hypers) for u in self.units for g in u.groups):
            raise ValueError(f"set_hypers: {len(hypers)} groups given, but parameters are assigned to more")
        self.hypers = hypers
        self.optimizer.hypers = hypers

    def set_lr(self, lr: float) -> None:
        """Sets the learning rate of every param group."""
        self.set_hypers([h.model_copy(update={"lr": AdamHyper(lr=lr).lr}) for h in self.hypers])

    def get_lr(self) -> float:
        return self.hypers[0].lr

    def _quiesce(self) -> None:
        """Between steps only: the optimizer has nothing in flight (the last step's pending updates
        applied), its writes are started."""
        self.optimizer.complete_pending()
        self.optimizer.finish()
        self.optimizer.flush_writes()

    def save_state(self, path: str, *, meta: Optional[dict] = None, files: tuple[str, ...] = (),
                   rank_files: tuple[str, ...] = (), progress: bool = False, node_local: bool = False) -> dict:  # fmt: skip
        """Streams the training state (fp32 master weights, Adam moments, step counts, the
        hyper-parameters, the loss scaler) into the empty folder `path`, unit by unit, durably;
        `meta` and the small `files` the caller wrote there go into its manifest
        (runtime/checkpoint.py). Between steps. Returns the manifest. Over several ranks a
        collective: each rank's shards go to rank_dir(path) with the `rank_files` the caller
        wrote there, the manifest and `files` are rank 0's (runtime/dp/sharded_checkpoint.py), or
        with node_local each node's first rank's, `path` being each node's own folder."""
        self._check_open()
        self._quiesce()
        self.store.wait_all()
        self.store.check_writes()
        runtime = {
            "global_step": self.global_step,
            "hypers": [h.model_dump() for h in self.hypers],  # one per param group
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }
        meta = {"runtime": runtime, **ckpt.names_meta(self.units), **(meta or {})}
        if self.dp is not None:
            return save_sharded(self.units, path, dp=self.dp, io=self.store.config, meta=meta, files=files,
                                rank_files=rank_files, node_local=node_local)  # fmt: skip
        return ckpt.save_state(self.units, path, io=self.store.config, meta=meta, files=files,
                               progress=progress)  # fmt: skip

    def rank_dir(self, path: str) -> str:
        """Where this rank's part of a checkpoint at `path` goes (path itself for one process)."""
        return rank_dir(path, self.dp.rank) if self.dp is not None else path

    def load_state(self, path: str, *, optimizer_states: bool = True, progress: bool = False,
                   before_apply: Optional[Callable[[], None]] = None) -> dict:  # fmt: skip
        """Reads a checkpoint save_state wrote into the engine (the weights only with
        optimizer_states=False), after checking it is this model's and intact. Returns its
        manifest. Between steps; a half-done accumulation window is dropped. All or nothing
        (runtime/checkpoint.py's Note): everything is verified first, `before_apply` (the
        caller's own checks and reads; over ranks, every rank's) runs next, and the engine is
        changed only if all passed; if it raises the engine is as before the call. A failure
        after that (a disk failing between the passes) leaves the engine failed."""
        self._check_open()
        manifest = ckpt.read_manifest(path)
        rt, hypers = ckpt.runtime_state(path, manifest)
        self._quiesce()
        self.store.wait_all()
        # The backend this engine already resolved: a probe would write into the checkpoint.
        io = self.store.config.model_copy(update={"backend": self.store.backends[0]})
        sharded = self.dp is not None or "world_size" in manifest  # (over ranks: resharded if need be)

        def verify() -> None:
            if sharded:
                verify_sharded(self.units, path, manifest, dp=self.dp, io=io, optimizer_states=optimizer_states,
                               progress=progress)  # fmt: skip
            else:
                ckpt.verify_state(self.units, path, manifest, io=io, optimizer_states=optimizer_states,
                                  progress=progress)  # fmt: skip
            if before_apply is not None:
                before_apply()

        if self.dp is not None:
            agreed(self.dp, f"verifying checkpoint {path!r}", verify)
        else:
            verify()
        try:
            if sharded:
                load_sharded(self.units, path, manifest, dp=self.dp, io=io, optimizer_states=optimizer_states,
                             progress=progress, verified=True)  # fmt: skip
            else:
                ckpt.load_state(self.units, path, manifest, io=io, optimizer_states=optimizer_states,
                                progress=progress)  # fmt: skip
            self.store.wait_all()
            self.store.check_writes()
        except BaseException as e:
            self.transaction.fail(e)  # half loaded: not to be trained on
            raise
        if optimizer_states:
            self.global_step = int(rt["global_step"])
            if self.loss_scaler is not None and rt.get("loss_scaler"):
                self.loss_scaler.load_state_dict(rt["loss_scaler"])
            if len(hypers) == len(self.hypers) or all(g == 0 for u in self.units for g in u.groups):
                self.set_hypers(hypers)
        self.micro_in_window = 0
        for u in self.units:
            u.start_window()
        return manifest

    def export_weights(self, save_dir: str, *, dtype: Optional[torch.dtype] = None, filename: str = "model.safetensors",
                       max_shard_bytes: Optional[int] = None, exclude_frozen: bool = False,
                       progress: bool = False, merge: Optional[export.Merge] = None) -> list[str]:  # fmt: skip
        """The current weights as files from_pretrained loads (safetensors, or torch.save's format
        for another name), unit by unit at bounded memory (runtime/export.py); dtype: the compute
        dtype unless given; max_shard_bytes: export.DEFAULT_SHARD_BYTES unless given; merge:
        adapters folded into their weights (export.Merge). Between steps."""
        self._check_open()
        dtype = dtype or TORCH_DTYPES[self.settings.compute_dtype]
        fmt = export.ExportFormat(dtype, filename, max_shard_bytes, exclude_frozen, merge=merge)
        return export.export_weights(self.units, self.module, save_dir, fmt, before=self._quiesce,
                                     progress=progress, write=self.dp is None or self.dp.rank == 0)  # fmt: skip

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable parameters' values by name (runtime/export.py), without reading the
        frozen base: what an adapter's save needs. Between steps."""
        self._check_open()
        return export.trainable_state_dict(self.units, self._quiesce)

    def budget_report(self):
        """Each budget with the most the engine held against it in this step and since it started
        (StepAccounting.budget_report)."""
        return self.accounting.budget_report()

    def peak_device_bytes(self) -> int:
        """Peak bytes of the runtime's own device buffers so far (activations not counted)."""
        return self.accounting.peak_device_bytes()

    def peak_host_bytes(self) -> int:
        """Peak bytes of the runtime's host buffers so far (optimizer state, gradients, staging)."""
        return self.accounting.peak_host_bytes()

    def predicted_for(self, updates: str, vertical: bool = True):
        """The cost model's estimate of a step whose updates ran as `updates`, vertically or not
        (StepAccounting.predicted_for)."""
        return self.accounting.predicted_for(updates, vertical)

    def disk_bytes(self) -> int:
        """Bytes the swap files occupy."""
        return self.store.disk_bytes()
