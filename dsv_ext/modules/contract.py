"""The typed contract between a driver (DSVController, evaluation, benchmarks) and a SparseAttention.

A driver decides, the module executes and measures:

* :class:`StepPlan` -- what one training step asks of a module, handed over with
  ``attn.plan_step(plan)`` (frozen: a new plan replaces the old one as a whole);
* :class:`ModuleStats` -- what the module's forwards measured since the last read, taken with
  ``attn.take_stats()`` (resets) or ``attn.peek_stats()`` (does not);
* :class:`Workload` -- the input shape of the module's latest training forward (``attn.workload``;
  ``attn.set_workload`` restores it from a checkpoint), which sizes per-head K and the
  dispatcher's cost estimate.

Nothing outside the module writes its private fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..config import KV_BLOCKS

__all__ = ["StepPlan", "ModuleStats", "Workload", "MODES"]

MODES = ("dense", "sparse")


@dataclass(frozen=True)
class StepPlan:
    """One step's decisions for one SparseAttention (the default plan: dense, no side work).

    stage       1 (dense attention, predictors learn) or 2 (DSV: sparse where ``mode`` says so)
    train       this step's training forwards train the predictors on the sampled rows
    profile     this step's training forwards profile per-head sparsity (and recall / the
                recall-versus-K curve, see DSVConfig.measure_recall and k_rule)
    row_offset  the sampled query rows are offset, offset + stride, ... (cube order;
                stride = config.row_sample_stride)
    mode        "sparse" or "dense": the dispatcher's choice for this block (read in stage 2)
    density     per-head K / S (None: no estimate yet; the sparse path then stays off)
    seq_len     the length K is sized for until a forward brings another one (None: the
                module's own workload length)
    kv_block    per-head list granularity, each in KV_BLOCKS (1 keys, 16 or 64 key blocks; the
                dispatcher's choice under DSVConfig.kv_block "auto"); None: the config's
                kv_block (1 while "auto" has not chosen). K stays in keys (density x S).
    """

    stage: int = 1
    train: bool = False
    profile: bool = False
    row_offset: int = 0
    mode: str = "dense"
    density: Optional[Tuple[float, ...]] = None
    seq_len: Optional[int] = None
    kv_block: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if self.stage not in (1, 2):
            raise ValueError(f"stage: expected 1 or 2, got {self.stage!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if not isinstance(self.row_offset, int) or self.row_offset < 0:
            raise ValueError(f"row_offset: expected an int >= 0, got {self.row_offset!r}")
        if self.density is not None:
            object.__setattr__(self, "density", tuple(float(d) for d in self.density))
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"seq_len: expected a positive int or None, got {self.seq_len!r}")
        if self.kv_block is not None:
            kb = tuple(self.kv_block)
            if not kb or any(isinstance(b, bool) or b not in KV_BLOCKS for b in kb):
                raise ValueError(f"kv_block: expected per-head values in {list(KV_BLOCKS)}, got {self.kv_block!r}")
            object.__setattr__(self, "kv_block", tuple(int(b) for b in kb))

    @property
    def side_tasks(self) -> bool:
        """Whether the plan asks the training forwards for any side work."""
        return self.train or self.profile


@dataclass(frozen=True)
class ModuleStats:
    """What a SparseAttention's training forwards measured since the last take_stats() (device
    tensors, no host sync; None where nothing was measured). Per-head values are means over the
    forwards (weighted by each forward's share of the rows under context parallelism).

    grads         (d wq, d wk): predictor gradients summed over the training forwards
    loss          [H] predictor loss
    sparsity      [H] profiled sparsity (fraction of keys outside config.theta of the mass)
    recall        [H] attention mass the predicted lists cover at the current K
    recall_curve  [H, ceil(S / k_multiple)] recall versus K (k_rule "recall")
    block_curves  [len(KV_BLOCKS), H, ceil(S / k_multiple)] recall versus K (in keys) of each list
                  granularity of KV_BLOCKS (DSVConfig.kv_block "auto"; row 0 is recall_curve)
    trained       number of forwards that trained the predictors
    profiled      number of forwards that profiled
    """

    grads: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    loss: Optional[torch.Tensor] = None
    sparsity: Optional[torch.Tensor] = None
    recall: Optional[torch.Tensor] = None
    recall_curve: Optional[torch.Tensor] = None
    block_curves: Optional[torch.Tensor] = None
    trained: int = 0
    profiled: int = 0


@dataclass(frozen=True)
class Workload:
    """The input of a module's latest training forward (its video part): sequence length
    (-1: none seen yet), batch size and dtype."""

    seq_len: int = -1
    batch: int = 1
    dtype: torch.dtype = torch.float32
