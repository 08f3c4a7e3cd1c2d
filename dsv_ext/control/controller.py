"""DSVController: predictor training, profiling, stage switching and op dispatch.

PUBLIC API
------------------------------------------------------
class DSVController:
    DSVController(model: nn.Module, config: DSVConfig | str | dict | None = None,
                  dispatcher: Dispatcher | None = None, process_group=None)
        Finds every SparseAttention in `model` (after dsv_ext.convert or DSVAttention layers),
        creates an AdamW over their predictors and arms step 0 (predictor training + profile).
        With torch.distributed initialised, predictor gradients and profiled statistics are
        averaged over `process_group` (default: the world) so every rank takes the same decisions.
        Predictor parameters have requires_grad=False: the model's own optimizer, DDP and
        zero_grad() never touch them (their grads live in SparseAttention until step()).
    step() -> None
        Call once per training step AFTER loss.backward() (before or after your optimizer step):
        steps the predictor optimizer, updates sparsity EMAs, checks the stage switch, arms the
        next step.
    stage: int                      # 1 or 2
    step_count: int                 # number of completed steps
    modules: list[tuple[str, SparseAttention]]
    optimizer: torch.optim.AdamW    # over the predictors only
    summary() -> dict               # {"dsv/stage", "dsv/step", "dsv/sparsity", "dsv/loss",
                                    #  "dsv/recall" (if measured), "dsv/sparse_blocks"}
    block_stats() -> list[dict]     # per block: name, head_sparsity, sparsity, recall, loss,
                                    #  use_sparse, head_k, head_density
    head_density(i) -> list[float] | None   # block i's per-head K / S (k_rule "recall": from the
                                    #  recall-versus-K measurement; heads at 1.0 attend to all keys)
    recall_density: list            # per block per head: K / S needed for config.recall_target
    kv_block_choice: list           # per block: per-head list granularity (config.kv_block "auto")
    mean_loss(sync=True) / mean_sparsity() / mean_recall() -> float | None
    state_dict() -> dict; load_state_dict(sd) -> None
        round-trip step, stage, EMAs, predictors and optimizer (a resumed run continues in the
        same stage with identical next steps).
    switch_to_stage2() -> None      # manual switch (also via config.force_stage2_step)
    set_sparsity(per_block_per_head, force_sparse=None) -> None   # override EMAs (benchmarks)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ..modules.attention import SparseAttention
from ..config import KV_BLOCKS, DSVConfig
from .dispatch import Dispatcher

__all__ = ["DSVController"]


def _as_config(config) -> DSVConfig:
    if config is None:
        return DSVConfig()
    if isinstance(config, DSVConfig):
        return config
    if isinstance(config, str):
        return DSVConfig.from_yaml(config)
    if isinstance(config, dict):
        return DSVConfig.from_dict(config)
    raise TypeError(f"config: expected a DSVConfig, a YAML path, a dict or None, got {type(config).__name__}")


class DSVController:
    """Drives every SparseAttention of a model through DSV's two stages (see module docstring).

    Per training step (`step()` arms the *next* step's forward):
      * stage 1: every `train_every_stage1` steps, each block's forward trains its predictor
        (sampled rows; loss + backward inside the forward, grads into the predictor only); step()
        then runs the predictor AdamW. On the profile schedule the forward measures per-head
        sparsity; step() folds it into the EMAs (one host sync per profile step).
      * the switch (config.switch_rule), at a check step (one host sync per check): "loss" when
        the mean over blocks of the (smoothed) predictor loss is below `switch_loss`; "dispatch"
        when the dispatcher would run some block sparse at the K's the recall rule measured for
        the predictors' lists (the lists pay from that step on). Or at `force_stage2_step`.
        Blocks without a sparsity estimate are profiled first (the switch waits one step).
      * stage 2: the dispatcher chooses sparse or dense per block from the EMAs; predictors
        fine-tune at `finetune_lr` every `train_every_stage2` steps; profiling continues (with
        recall of the predicted index) and refreshes per-head K.
      * per-head K (config.k_rule): "recall" (default) takes the smallest K at which the predicted
        lists cover config.recall_target of the attention mass on the profiled rows (it rises at
        once, falls with the EMA; a measured miss doubles it; heads needing more than
        recall_max_density attend to all keys); "theta" takes (1 - sparsity + k_margin) * S.
    """

    def __init__(self, model: nn.Module, config: Union[DSVConfig, str, dict, None] = None,
                 dispatcher: Optional[Dispatcher] = None, process_group=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        self.model = model
        self.process_group = process_group
        self.modules: List[Tuple[str, SparseAttention]] = [
            (n, m) for n, m in model.named_modules() if isinstance(m, SparseAttention)]
        if not self.modules:
            raise ValueError("model: contains no SparseAttention (use DSVAttention layers or dsv_ext.convert first)")
        # config None: the one the modules were built with (convert / DSVAttention)
        self.config = _as_config(config) if config is not None else self.modules[0][1].config
        bad = [(n, m.predictor.rank) for n, m in self.modules if m.predictor.rank != self.config.rank]
        if bad:
            raise ValueError(f"config: rank={self.config.rank} differs from the predictor rank {bad[0][1]} of "
                             f"{bad[0][0]}; build the model (DSVAttention / dsv_ext.convert) with this config")
        for n, m in self.modules:
            m.config = self.config
            if m.name is None:
                m.name = n
        far = sorted(i for i in (self.config.block_recall_targets or {}) if i >= len(self.modules))
        if far:
            raise ValueError(f"config: block_recall_targets names block {far[0]}, but the model has "
                             f"{len(self.modules)} SparseAttention blocks (indices 0 to {len(self.modules) - 1})")
        self.dispatcher = dispatcher if dispatcher is not None else Dispatcher(self.config)
        params = [p for _, m in self.modules for p in m.predictor.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=self.config.predictor_lr, betas=self.config.predictor_betas,
                                           weight_decay=self.config.predictor_weight_decay)
        nb = len(self.modules)
        self.step_count: int = 0
        self.stage: int = 1
        self._switch_pending: bool = False
        self._choosing: bool = False  # _dispatch_choice in stage 1: the choice the switch would make
        self.sparsity_ema: List[Optional[List[float]]] = [None] * nb   # host, per block per head
        self.recall: List[Optional[List[float]]] = [None] * nb          # latest measured, host
        # k_rule "recall": per block per head, the (smoothed) fraction of keys the predicted lists
        # need to reach recall_target, before the recall_max_density cap (host)
        self.recall_density: List[Optional[List[float]]] = [None] * nb
        # kv_block "auto": per block, per granularity of KV_BLOCKS, per head the (smoothed) density
        # needed for recall_target, and the per-head granularity the dispatcher chose (host)
        self.block_density: List[Optional[List[List[float]]]] = [None] * nb
        self.kv_block_choice: List[Optional[Tuple[int, ...]]] = [None] * nb
        self._loss_ema: List[Optional[torch.Tensor]] = [None] * nb      # device [H], no sync
        self._last_loss_host: Optional[float] = None
        self._trained_this_step = False
        self.switch_step: Optional[int] = None
        self._arm()

    # ---------------------------------------------------------------- the modules' step plans
    @staticmethod
    def _plan(m: SparseAttention, **decisions) -> None:
        """Hand block m its step plan with these decisions changed (the rest as in force)."""
        m.plan_step(replace(m.plan, **decisions))

    def _arm(self) -> None:
        """Plan the forwards of the next step (self.step_count): stage, training, profiling, rows."""
        s, cfg = self.step_count, self.config
        train = cfg.train_due(s, self.stage)
        profile = cfg.profile_due(s) or (self._switch_pending and any(e is None for e in self.sparsity_ema))
        # rotate the sampled rows: offset (s * 7) mod stride visits every residue (stride a power of 2)
        off = (s * 7) % cfg.row_sample_stride
        for _, m in self.modules:
            self._plan(m, stage=self.stage, train=train, profile=profile, row_offset=off)
        self._trained_this_step = train

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self) -> None:
        """Once per training step, after loss.backward()."""
        cfg = self.config
        profiled = False
        stats = [m.take_stats() for _, m in self.modules]
        for i, st in enumerate(stats):
            if st.loss is not None:
                a = cfg.loss_ema_alpha
                prev = self._loss_ema[i]
                self._loss_ema[i] = st.loss.clone() if prev is None else prev.mul(a).add_(st.loss, alpha=1 - a)
        sparsities = [st.sparsity for st in stats]
        recalls = [st.recall for st in stats]
        grads = [(m, st.grads) for (_, m), st in zip(self.modules, stats)]
        if any(g is not None for _, g in grads):
            self._sync_grads(grads)
            for m, g in grads:
                if g is not None:
                    m.predictor.wq.grad = g[0].to(m.predictor.wq.dtype)
                    m.predictor.wk.grad = g[1].to(m.predictor.wk.dtype)
            self.optimizer.step()
            for m, _ in grads:
                m.predictor.wq.grad = None
                m.predictor.wk.grad = None

        # profile results -> EMAs (one host transfer for all blocks)
        idx = [i for i, sp in enumerate(sparsities) if sp is not None]
        if idx:
            profiled = True
            # one transfer for all blocks; blocks may have different head counts
            host = self._split(self._sync_stats(torch.cat([sparsities[i].reshape(-1) for i in idx])),
                               [sparsities[i].numel() for i in idx])
            for i, new in zip(idx, host):
                old = self.sparsity_ema[i]
                a = cfg.ema_alpha
                self.sparsity_ema[i] = list(new) if old is None else [a * o + (1 - a) * n for o, n in zip(old, new)]
            ridx = [i for i, r in enumerate(recalls) if r is not None]
            measured = {}
            if ridx:
                rhost = self._split(self._sync_stats(torch.cat([recalls[i].reshape(-1) for i in ridx])),
                                    [recalls[i].numel() for i in ridx])
                for i, r in zip(ridx, rhost):
                    self.recall[i] = list(r)
                    measured[i] = list(r)
            self._update_recall_density([st.recall_curve for st in stats], measured)
            self._update_block_choice([st.block_curves for st in stats], measured)

        s = self.step_count  # the step that just finished
        # stage switch
        if self.stage == 1:
            due = cfg.force_stage2_step is not None and s + 1 >= cfg.force_stage2_step
            if not due and s + 1 >= cfg.min_stage1_steps and (s + 1) % cfg.switch_check_every == 0:
                if cfg.switch_rule == "loss":
                    ml = self.mean_loss(sync=True, reduce=True)
                    due = ml is not None and ml < cfg.switch_loss
                elif all(e is not None for e in self.sparsity_ema):  # "dispatch"
                    self._choosing = True
                    try:
                        due = any(self._dispatch_choice())
                    finally:
                        self._choosing = False
            if due or self._switch_pending:
                if all(e is not None for e in self.sparsity_ema):
                    self._do_switch(s + 1)
                else:
                    self._switch_pending = True
        if profiled and not (self.stage == 2 and self.switch_step == s + 1):
            self._update_dispatch()
        self.step_count = s + 1
        self._arm()

    @staticmethod
    def _split(flat: torch.Tensor, sizes: List[int]) -> List[List[float]]:
        vals, out, o = flat.cpu().tolist(), [], 0
        for n in sizes:
            out.append(vals[o:o + n])
            o += n
        return out

    def _auto_calibrate(self, blocks) -> None:
        """Measure the calibration table once for each new (device, dtype, H, D, S) of the model."""
        done = set()
        for b in blocks:
            key = (str(b["device"]), b["dtype"], b["heads"], b["head_dim"], b["seq_len"])
            if key in done or torch.device(b["device"]).type != "cuda":
                continue
            done.add(key)
            if not self.dispatcher.has_entry(b["device"], b["dtype"], b["heads"], b["head_dim"], b["seq_len"]):
                self.dispatcher.calibrate(b["device"], seq_lens=(b["seq_len"],), heads=b["heads"],
                                          head_dim=b["head_dim"], dtype=b["dtype"], repeats=2)

    def _sync_grads(self, grads) -> None:
        """Average predictor gradients over the data-parallel group (if torch.distributed is up)."""
        pg = self.process_group
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        if torch.distributed.get_world_size(pg) <= 1:
            return
        ts = [t for _, g in grads if g is not None for t in g]
        flat = torch.cat([t.reshape(-1).float() for t in ts])
        torch.distributed.all_reduce(flat, group=pg)
        flat /= torch.distributed.get_world_size(pg)
        o = 0
        for t in ts:
            t.copy_(flat[o:o + t.numel()].view_as(t))
            o += t.numel()

    def _sync_stats(self, t: torch.Tensor) -> torch.Tensor:
        pg = self.process_group
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size(pg) > 1:
            t = t.clone()
            torch.distributed.all_reduce(t, group=pg)
            t /= torch.distributed.get_world_size(pg)
        return t

    def _update_recall_density(self, curves: List[Optional[torch.Tensor]],
                               measured: Dict[int, List[float]]) -> None:
        """k_rule "recall": fold the recall-versus-K curves of this profile step (per block, from
        take_stats) into the per-head densities (one host transfer for all blocks). The density
        needed for recall_target rises at once and falls with the EMA; a head whose recall,
        measured with the real index at its K (``measured``), missed the target by more than
        recall_tolerance gets twice its density."""
        cfg = self.config
        idx = [i for i, c in enumerate(curves) if c is not None]
        if cfg.k_rule != "recall" or not idx:
            return
        from ..recall import density_for_recall

        host = self._split(self._sync_stats(torch.cat([curves[i].reshape(-1) for i in idx])),
                           [curves[i].numel() for i in idx])
        a = cfg.ema_alpha
        for i, flat in zip(idx, host):
            m = self.modules[i][1]
            H, S = m.num_heads, m.workload.seq_len
            nb = len(flat) // H
            if S <= 0 or nb != -(-S // cfg.k_multiple):
                continue
            target = cfg.recall_target_of(i)
            new = [density_for_recall(flat[h * nb:(h + 1) * nb], target, S, cfg.k_multiple)
                   for h in range(H)]
            old = self.recall_density[i]
            if old is not None:
                new = [n if n >= o else a * o + (1 - a) * n for o, n in zip(old, new)]
                rec = measured.get(i)
                if rec is not None:
                    new = [min(1.0, max(n, 2.0 * o)) if r < target - cfg.recall_tolerance else n
                           for n, o, r in zip(new, old, rec)]
            self.recall_density[i] = new

    @staticmethod
    def _kernel_dtype(m: SparseAttention) -> torch.dtype:
        dt = m.workload.dtype
        if m.kv_count.is_cuda and dt not in (torch.bfloat16, torch.float16):
            dt = torch.bfloat16  # the CUDA kernels run in bf16 (see functional.attention.kernel_dtype)
        return dt

    def _update_block_choice(self, curves: List[Optional[torch.Tensor]], measured: Dict[int, List[float]]) -> None:
        """kv_block "auto": from the recall-versus-K curves of every granularity (ModuleStats.
        block_curves, one host transfer for all blocks), per head the density each granularity
        needs for recall_target (rising at once, falling with the EMA; a measured miss of the
        chosen granularity doubles its density, as in _update_recall_density), then the
        dispatcher's choice of granularity; the chosen densities become recall_density."""
        cfg = self.config
        idx = [i for i, c in enumerate(curves) if c is not None]
        if cfg.kv_block != "auto" or cfg.k_rule != "recall" or not idx:
            return
        from ..recall import density_for_recall

        host = self._split(self._sync_stats(torch.cat([curves[i].reshape(-1) for i in idx])),
                           [curves[i].numel() for i in idx])
        a, ng = cfg.ema_alpha, len(KV_BLOCKS)
        for i, flat in zip(idx, host):
            m = self.modules[i][1]
            H, S = m.num_heads, m.workload.seq_len
            nbins = len(flat) // (H * ng)
            if S <= 0 or nbins != -(-S // cfg.k_multiple):
                continue
            target = cfg.recall_target_of(i)
            new = [[density_for_recall(flat[(g * H + h) * nbins:(g * H + h + 1) * nbins], target, S,
                                       cfg.k_multiple) for h in range(H)] for g in range(ng)]
            old, prev = self.block_density[i], self.kv_block_choice[i]
            if old is not None:
                new = [[n if n >= o else a * o + (1 - a) * n for o, n in zip(og, nw)] for og, nw in zip(old, new)]
                rec = measured.get(i)
                if rec is not None and prev is not None:
                    for h, (r, b) in enumerate(zip(rec, prev)):
                        g = KV_BLOCKS.index(b)
                        if r < target - cfg.recall_tolerance:
                            new[g][h] = min(1.0, max(new[g][h], 2.0 * old[g][h]))
            self.block_density[i] = new
            choice = tuple(self.dispatcher.choose_kv_block(new, S, H, m.head_dim, m.kv_count.device,
                                                           self._kernel_dtype(m), m.workload.batch))
            self.kv_block_choice[i] = choice
            self.recall_density[i] = [new[KV_BLOCKS.index(b)][h] for h, b in enumerate(choice)]

    def head_density(self, i: int) -> Optional[List[float]]:
        """Per-head density (K / S) block ``i`` runs with: from the recall rule where it has a
        measurement (heads over recall_max_density at 1.0, all keys), else 1 - sparsity EMA."""
        cfg = self.config
        rd = self.recall_density[i]
        if cfg.k_rule == "recall" and rd is not None:
            return [1.0 if d > cfg.recall_max_density else d for d in rd]
        ema = self.sparsity_ema[i]
        return None if ema is None else [1.0 - s for s in ema]

    def _do_switch(self, at_step: int) -> None:
        self.stage = 2
        self._switch_pending = False
        self.switch_step = at_step
        for g in self.optimizer.param_groups:
            g["lr"] = self.config.finetune_lr
        self._update_dispatch()

    def set_sparsity(self, sparsity, force_sparse: Optional[bool] = None) -> None:
        """Override the per-block, per-head sparsity EMAs (e.g. from a profiled run, for benchmarks):
        sparsity is a list over blocks of per-head lists (or one float per block). Per-head K and,
        in stage 2, the dispatcher's choice are recomputed; force_sparse=True/False then overrides
        the choice for every block that supports the sparse path."""
        if len(sparsity) != len(self.modules):
            raise ValueError(f"sparsity: expected {len(self.modules)} blocks, got {len(sparsity)}")
        new = []
        for s, (_, m) in zip(sparsity, self.modules):
            s = [float(s)] * m.num_heads if isinstance(s, (int, float)) else [float(x) for x in s]
            if len(s) != m.num_heads or not all(0.0 <= x <= 1.0 for x in s):
                raise ValueError(f"sparsity: expected {m.num_heads} values in [0, 1] per block, got {s}")
            new.append(s)
        self.sparsity_ema = new
        self.recall_density = [None] * len(self.modules)  # the given sparsity sets K (theta rule)
        self.block_density = [None] * len(self.modules)
        self.kv_block_choice = [None] * len(self.modules)
        self._update_dispatch()
        if force_sparse is not None and self.stage == 2:
            for _, m in self.modules:
                sparse = bool(force_sparse) and m.sparse_supported() and m.density is not None
                self._plan(m, mode="sparse" if sparse else "dense")

    def switch_to_stage2(self) -> None:
        """Switch now (blocks without a sparsity estimate are profiled on the next step first)."""
        if self.stage == 1:
            if all(e is not None for e in self.sparsity_ema):
                self._do_switch(self.step_count)
            else:
                self._switch_pending = True
            self._arm()

    def _update_dispatch(self) -> None:
        """Per-head K of every block from the EMAs and, in stage 2, the sparse/dense choice of the
        dispatcher (host only). In stage 1 the K's serve the recall measurement."""
        use = self._dispatch_choice()
        for (_, m), u in zip(self.modules, use):
            self._plan(m, mode="sparse" if u and self.stage == 2 else "dense")

    def _dispatch_choice(self) -> List[bool]:
        """Plan every block's per-head K from the EMAs and return the blocks the dispatcher runs
        sparse at those K's (in stage 1: would run, once switched; all False while no block
        has a measurement). A collective where data-parallel (_agree): called at the same steps
        on every rank."""
        blocks = []
        cfg = self.config
        all_keys = [False] * len(self.modules)  # every head attends to all keys: the block stays dense
        for i, (_, m) in enumerate(self.modules):
            dens = self.head_density(i)
            if dens is None:
                self._plan(m, density=None)
                blocks.append(None)
                continue
            all_keys[i] = all(d >= 1.0 for d in dens)
            by_recall = cfg.k_rule == "recall" and self.recall_density[i] is not None
            if by_recall:
                # K = head_k(1 - d) adds k_margin (a theta-rule knob): take it off the recall rule's
                dens = [d - cfg.k_margin for d in dens]
            self._plan(m, density=tuple(dens), kv_block=self.kv_block_choice[i] if by_recall else None)
            ema = self.sparsity_ema[i] if self.sparsity_ema[i] is not None else [1.0 - d for d in dens]
            w = m.workload
            S = w.seq_len if w.seq_len > 0 else 0
            # the recall rule: the dispatcher weighs the K's the block runs with
            kd = [k / S for k in m.head_k] if by_recall and S > 0 and m.head_k else None
            dt = self._kernel_dtype(m)
            kb = m.head_kv_block
            blocks.append(dict(sparsity=ema, seq_len=S, heads=m.num_heads, head_dim=m.head_dim, kmax=m.kmax,
                               dtype=dt, batch=w.batch, device=m.kv_count.device, density=kd,
                               kv_block=None if all(b == 1 for b in kb) else list(kb)))
        if self.stage == 1 and not self._choosing:
            return [False] * len(self.modules)
        blocks = [b if b is not None and b["seq_len"] > 0 and m.sparse_supported() else None
                  for b, (_, m) in zip(blocks, self.modules)]
        valid = [b for b in blocks if b is not None]
        if self.config.auto_calibrate and self.config.use_calibration:
            self._auto_calibrate(valid)
        choice = iter(self.dispatcher.plan(valid, valid[0]["device"]) if valid else [])
        use = [bool(next(choice)) and not f if b is not None else False for b, f in zip(blocks, all_keys)]
        return self._agree(use)

    def _agree(self, use: List[bool]) -> List[bool]:
        """A block runs sparse only where every data-parallel rank chose sparse: the memory check
        reads each rank's own free memory (and blocks may have seen other lengths), so ranks can
        differ; they must not, or their numerics and step times drift apart. A collective: every
        rank calls it from step() at the same steps."""
        pg = self.process_group
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
                torch.distributed.get_world_size(pg) <= 1 or not use:
            return use
        dev = self.modules[0][1].kv_count.device
        t = torch.tensor([1 if u else 0 for u in use], dtype=torch.int32, device=dev)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=pg)
        return [bool(x) for x in t.tolist()]

    # ---------------------------------------------------------------- reporting
    def mean_loss(self, sync: bool = True, reduce: bool = False) -> Optional[float]:
        """Mean over blocks (and heads) of the smoothed predictor loss. sync: read the device value
        (a host sync; else the last value read). reduce: average over the data-parallel group
        (a collective: every rank must call it, as step() does)."""
        ls = [l for l in self._loss_ema if l is not None]
        if not ls:
            return None
        if sync:
            t = torch.stack([l.mean() for l in ls]).mean()
            self._last_loss_host = float(self._sync_stats(t) if reduce else t)
        return self._last_loss_host

    def mean_sparsity(self) -> Optional[float]:
        es = [sum(e) / len(e) for e in self.sparsity_ema if e is not None]
        return sum(es) / len(es) if es else None

    def mean_recall(self) -> Optional[float]:
        rs = [sum(r) / len(r) for r in self.recall if r is not None]
        return sum(rs) / len(rs) if rs else None

    def block_stats(self) -> List[Dict[str, Any]]:
        """Per block: name, head_sparsity (EMA list), sparsity (mean), recall (latest, mean),
        loss (smoothed, mean over heads; one host sync for all blocks), use_sparse, head_k."""
        ls = [l for l in self._loss_ema if l is not None]
        host = iter(torch.stack([l.float().mean() for l in ls]).cpu().tolist()) if ls else iter(())
        out = []
        for i, (n, m) in enumerate(self.modules):
            e, r = self.sparsity_ema[i], self.recall[i]
            out.append({
                "name": n,
                "head_sparsity": None if e is None else list(e),
                "sparsity": None if e is None else sum(e) / len(e),
                "recall": None if r is None else sum(r) / len(r),
                "loss": next(host) if self._loss_ema[i] is not None else None,
                "use_sparse": bool(self.stage == 2 and m.use_sparse),
                "head_k": m.head_k,
                "head_density": self.head_density(i),
                "kv_block": list(m.head_kv_block),
            })
        return out

    def summary(self) -> Dict[str, Any]:
        """Plain-Python dict for logging (one host sync for the loss)."""
        out: Dict[str, Any] = {
            "dsv/stage": self.stage,
            "dsv/step": self.step_count,
            "dsv/sparsity": self.mean_sparsity(),
            "dsv/loss": self.mean_loss(sync=True),
            "dsv/sparse_blocks": sum(1 for _, m in self.modules if self.stage == 2 and m.use_sparse),
            "dsv/blocks": len(self.modules),
        }
        r = self.mean_recall()
        if r is not None:
            out["dsv/recall"] = r
        if self.switch_step is not None:
            out["dsv/switch_step"] = self.switch_step
        return out

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        return {
            "version": 1,
            "step": self.step_count,
            "stage": self.stage,
            "switch_pending": self._switch_pending,
            "switch_step": self.switch_step,
            "names": [n for n, _ in self.modules],
            "sparsity_ema": [None if e is None else list(e) for e in self.sparsity_ema],
            "recall": [None if r is None else list(r) for r in self.recall],
            "recall_density": [None if r is None else list(r) for r in self.recall_density],
            "block_density": [None if r is None else [list(x) for x in r] for r in self.block_density],
            "kv_block_choice": [None if c is None else list(c) for c in self.kv_block_choice],
            "loss_ema": [None if l is None else l.detach().cpu().clone() for l in self._loss_ema],
            "blocks": [{"seq_len": m.workload.seq_len, "dtype": str(m.workload.dtype).replace("torch.", ""),
                        "batch": m.workload.batch, "use_sparse": m.use_sparse} for _, m in self.modules],
            "predictors": {n: {k: v.detach().cpu().clone() for k, v in m.predictor.state_dict().items()}
                           for n, m in self.modules},
            "optimizer": self.optimizer.state_dict(),
            "config": self.config.to_dict(),
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        names = [n for n, _ in self.modules]
        if list(sd.get("names", [])) != names:
            raise ValueError(f"state_dict: blocks {sd.get('names')} do not match this model's {names}")
        for n, m in self.modules:
            m.predictor.load_state_dict(sd["predictors"][n])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.step_count = int(sd["step"])
        self.stage = int(sd["stage"])
        self._switch_pending = bool(sd.get("switch_pending", False))
        self.switch_step = sd.get("switch_step")
        self.sparsity_ema = [None if e is None else [float(x) for x in e] for e in sd["sparsity_ema"]]
        self.recall = [None if r is None else [float(x) for x in r] for r in sd.get("recall", [None] * len(names))]
        self.recall_density = [None if r is None else [float(x) for x in r]
                               for r in sd.get("recall_density", [None] * len(names))]
        self.block_density = [None if r is None else [[float(x) for x in g] for g in r]
                              for r in sd.get("block_density", [None] * len(names))]
        self.kv_block_choice = [None if c is None else tuple(int(x) for x in c)
                                for c in sd.get("kv_block_choice", [None] * len(names))]
        self._loss_ema = [None if l is None else l.to(m.kv_count.device) for l, (_, m) in zip(sd["loss_ema"], self.modules)]
        for b, (_, m) in zip(sd.get("blocks", []), self.modules):
            m.set_workload(int(b["seq_len"]), int(b["batch"]), getattr(torch, b["dtype"]))
        for _, m in self.modules:  # discard what forwards before the load measured / accumulated
            m.take_stats()
        self._update_dispatch()
        if self.stage == 2:
            # keep the exact per-block decisions of the saved run (they depend on free memory)
            for b, (_, m) in zip(sd.get("blocks", []), self.modules):
                sparse = bool(b["use_sparse"]) and m.density is not None
                self._plan(m, mode="sparse" if sparse else "dense")
        self._arm()
