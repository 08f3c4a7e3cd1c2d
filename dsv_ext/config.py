"""DSVConfig: every threshold, schedule, rank and rate of the DSV drop-in attention.

One dataclass holds all knobs of SparseAttention / DSVController / the op dispatcher. Defaults
follow the DSV paper (arXiv 2502.07590). Load overrides from YAML:

    cfg = DSVConfig.from_yaml("configs/dsv_default.yaml")
    cfg = DSVConfig(rank=8, switch_loss=0.02)          # or in code
    cfg.to_dict()                                       # plain dict (YAML/JSON friendly)

Unknown YAML keys raise a ValueError naming the key (typos must not be silently ignored).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple, Union

__all__ = ["DSVConfig", "KV_BLOCKS"]

# the key-block sizes of the sparse path: 1 = token lists (see DSVConfig.kv_block)
KV_BLOCKS = (1, 16, 64)


def check_int(section: str, name: str, v, lo: int = 0) -> None:
    """ValueError naming ``section.name`` unless v is an integer (not a bool) >= lo."""
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{section}.{name}: expected an integer >= {lo}, got {v!r}")


def check_number(section: str, name: str, v, lo: float = 0.0, lo_open: bool = False) -> None:
    """ValueError naming ``section.name`` unless v is a finite number >= lo (> lo if lo_open)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or \
            v < lo or (lo_open and v == lo):
        raise ValueError(f"{section}.{name}: expected a number {'>' if lo_open else '>='} {lo}, got {v!r}")


def check_bool(section: str, name: str, v) -> None:
    """ValueError naming ``section.name`` unless v is a bool."""
    if not isinstance(v, bool):
        raise ValueError(f"{section}.{name}: expected true or false, got {v!r}")


def check_choice(section: str, name: str, v, choices) -> None:
    """ValueError naming ``section.name`` unless v is one of ``choices``."""
    if v not in choices:
        raise ValueError(f"{section}.{name}: expected one of {list(choices)}, got {v!r}")


@dataclass
class DSVConfig:
    # ---------------------------------------------------------------- predictors
    rank: int = 16
    """Rank r of the per-head low-rank predictor projections (head_dim -> r) for q and k."""
    predictor_lr: float = 1e-4
    """AdamW learning rate of the predictors during stage 1 (their own optimizer)."""
    finetune_lr: float = 1e-5
    """AdamW learning rate of the predictors after the switch to stage 2 (fine-tuning)."""
    predictor_betas: Tuple[float, float] = (0.9, 0.999)
    """AdamW betas of the predictor optimizer."""
    predictor_weight_decay: float = 0.0
    """AdamW weight decay of the predictor optimizer."""
    cos_weight: float = 0.95
    """Weight of the cosine term of the predictor loss (see dsv_ext.predictor_loss)."""
    norm_weight: float = 0.05
    """Weight of the norm-matching term of the predictor loss."""
    row_sample_stride: int = 16
    """Query rows sampled for the predictor loss and the profiler: 1 row in this many
    (a strided set with an offset that rotates deterministically with the step)."""
    train_every_stage1: int = 1
    """Train the predictors every this many steps in stage 1 (1 = every step)."""
    train_every_stage2: int = 10
    """Train (fine-tune) the predictors every this many steps in stage 2 (0 = never)."""

    # ---------------------------------------------------------------- profiler
    theta: float = 0.9
    """Critical-KV mass: the critical set of a query is the smallest set of keys whose exact
    softmax probabilities sum to at least theta. Head sparsity = 1 - mean |critical| / S."""
    ema_alpha: float = 0.9
    """EMA of per-head sparsity: ema = alpha * ema + (1 - alpha) * measured (first = measured)."""
    profile_every: int = 25
    """Profile every this many steps while step < profile_until (step 0 included)."""
    profile_until: int = 2000
    """Step after which the profile interval becomes profile_every_late."""
    profile_every_late: int = 100
    """Profile every this many steps from profile_until on."""
    measure_recall: bool = True
    """On profile steps, also measure the recall (exact attention mass covered by the predicted
    index) once a block has a sparsity estimate. Costs one extra top-K estimation then (none
    while every head of the block takes K = S: its recall is 1)."""

    # ---------------------------------------------------------------- stage switch
    switch_rule: str = "loss"
    """When stage 2 begins (checked every switch_check_every steps). "loss": once the mean
    predictor loss over blocks falls below switch_loss (DSV's rule). "dispatch": once the
    dispatcher would run at least one block sparse at the per-head K's the recall rule measured
    for the predictors' lists (needs k_rule "recall"): the lists cover recall_target of the
    attention mass from the first profile on, so the switch waits only until they are short
    enough to pay. A predictor loss that plateaus above switch_loss (e.g. with rotary positions)
    then does not hold the run in stage 1."""
    switch_loss: float = 0.01
    """switch_rule "loss": switch to stage 2 when the mean predictor loss over blocks falls below
    this."""
    loss_ema_alpha: float = 0.9
    """Smoothing of the per-block predictor loss used by the switch criterion
    (ema = alpha * ema + (1 - alpha) * loss; 0 = use the latest loss only)."""
    switch_check_every: int = 25
    """Evaluate the switch criterion every this many steps (each check is one host sync)."""
    min_stage1_steps: int = 0
    """Never switch on the switch criterion before this step."""
    force_stage2_step: Optional[int] = None
    """If set, switch to stage 2 at this step at the latest (None = the switch criterion only)."""

    # ---------------------------------------------------------------- sparse attention
    cube: Tuple[int, int, int] = (4, 4, 4)
    """3D cube (time, height, width) of the token grid whose tokens are made contiguous before
    grouping (4x4x4 = 64 tokens; a query group of 128 is two neighbouring cubes). Grids not
    divisible by the cube get partial edge cubes (e.g. a grid of 2 frames has 2x4x4 cubes only);
    DSV's original choice was 2x4x4."""
    group_size: int = 128
    """G: consecutive (cube-ordered) queries sharing one critical-KV list; the last group of a
    sequence that is not a multiple of G (or shorter than G) is partial. 128 by default: on the
    H200, at the same keys per list, the kernels at G = 128 take ~0.7x the time of G = 64 and
    G = 64 ~0.5x the time of G = 32 (fewer dK / dV reductions per key), while on attention of a
    DiT trained on real video G = 128 lists need only ~3% more of the keys than G = 64 lists,
    and those ~1% more than G = 32 ones, for the same recall: at recall 0.9, 347 ms against 534
    and 1064 ms at 64k tokens (benchmarks/results/equal_recall/equal_recall.md). The paper's
    setting: group_size=32, cube=(2, 4, 4)."""
    kv_block: Union[int, str] = 1
    """Key granularity of the critical-KV lists: 1 (token lists, DSV's rule), 16 or 64 (lists of
    key blocks: b consecutive keys in the cube order of the queries, e.g. a 1x4x4 patch for b = 16;
    b consecutive positions without a grid), or "auto": per head, the granularity the
    dispatcher expects to be fastest among those whose predicted lists reach recall_target
    (from the recall-versus-K curve of each granularity; needs k_rule "recall"). Block lists
    need more keys for the same recall; on the H200 at G = 128 64-key lists run a little faster
    per key (0.92x the time of token lists; 0.65x at G = 64), 16-key lists do not (1.07x;
    dispatch.BLOCK_COST_RATIOS). Per-head K stays a number of keys; the lists hold ceil(K / b)
    blocks."""
    min_density: float = 0.02
    """Per-head K is at least this fraction of S."""
    k_multiple: int = 64
    """Per-head K is rounded up to a multiple of this (the kernel's K tile); capped at S."""
    k_margin: float = 0.0
    """Extra density added to (1 - s_h) before computing K (safety margin; 0 = paper's rule)."""
    k_rule: str = "recall"
    """How per-head K is chosen. "recall": the smallest K (on the k_multiple grid) at which the
    predicted lists cover ``recall_target`` of the exact attention mass on the profiler's sampled
    rows (measured on every profile step, see dsv_ext.recall). "theta": the paper's rule,
    K = (1 - sparsity at theta + k_margin) * S. Blocks without a recall measurement yet (or whose
    sparsity was set by DSVController.set_sparsity) use the theta rule."""
    recall_target: float = 0.95
    """Recall target of the "recall" K rule: mean fraction of the exact attention mass the
    predicted lists must cover. The default is the lowest target of the measured quality frontier
    whose paired loss increase is resolved below 1% (docs/QUALITY.md)."""
    block_recall_targets: Optional[Dict[int, float]] = None
    """"recall" rule: per-block overrides of recall_target, by the block's index in the controller's
    order (its ``modules``, the model's SparseAttention layers in definition order), e.g.
    ``{3: 0.98}`` for a block whose missing attention mass costs quality (a paired evaluation per
    block, ``python -m dsv_ext.app.evaluate``, tells which). Blocks not named use recall_target."""
    recall_max_density: float = 0.5
    """"recall" rule: a head that needs more than this fraction of the keys to reach the target
    attends to all keys (K = S: exact attention for that head, computed by dense attention on that
    head while the block's other heads run sparse); a block whose heads all do stays dense."""
    recall_tolerance: float = 0.02
    """"recall" rule: a head whose recall, measured with the real index at its K on a profile step,
    is below recall_target - recall_tolerance gets twice its density (or all keys) at once."""
    recall_rows: int = 256
    """"recall" rule: at most this many of the sampled rows (per block, batch element and profile
    step) feed the recall-versus-K measurement."""

    # ---------------------------------------------------------------- dispatcher
    dispatch_threshold: float = 0.8
    """Without a calibration table, a block runs sparse when its mean head sparsity >= this."""
    calibration_path: Optional[str] = None
    """JSON calibration table of dense vs sparse time; None = ~/.cache/dsv_ext/calibration.json."""
    use_calibration: bool = True
    """Use the calibration table when one exists for this device (else the threshold rule)."""
    auto_calibrate: bool = False
    """At the switch to stage 2, measure (and cache) the calibration table for this device, dtype,
    head count, head dim and sequence length when it has no entry for them yet (CUDA only; takes
    seconds to a minute of the training run once)."""
    dispatch_margin: float = 0.05
    """With a table, sparse must be at least this fraction faster than dense to be chosen."""
    memory_fraction: float = 0.5
    """Keep blocks dense when the extra memory of the sparse path (over all sparse blocks) would
    exceed this fraction of the free device memory (CUDA only)."""

    # ---------------------------------------------------------------- dense path
    dense_backend: str = "auto"
    """Stage-1 SDPA backend: "auto" (CUDA: cuDNN > Flash > memory-efficient > math by priority;
    CPU: torch's default) or "default" (leave torch's choice alone)."""

    # ---------------------------------------------------------------- reproducibility
    deterministic: Optional[bool] = None
    """Bit-identical sparse-attention gradients from run to run (ordered reductions, no float
    atomics; CUDA head_dim <= 128; some backward speed). None follows
    torch.are_deterministic_algorithms_enabled(). See docs/API.md, "Determinism"."""

    def __post_init__(self) -> None:
        for name, conv in (("cube", int), ("predictor_betas", float)):
            v = getattr(self, name)
            try:
                vals = tuple(v)
                t = tuple(conv(x) for x in vals)
            except (TypeError, ValueError):
                raise ValueError(f"{name}: expected a sequence of numbers, got {v!r}") from None
            if any(a != b for a, b in zip(t, vals)):  # e.g. a cube of (2.5, 4, 4): no truncation
                raise ValueError(f"{name}: expected {'integers' if conv is int else 'numbers'}, got {v!r}")
            setattr(self, name, t)
        bt = self.block_recall_targets
        if bt is not None:  # keys may come back as strings from JSON; values as any number
            if not isinstance(bt, dict):
                raise ValueError(f"block_recall_targets: expected a mapping of block index to target, got {bt!r}")
            out = {}
            for key, val in bt.items():
                if isinstance(key, bool) or not ((isinstance(key, int) and key >= 0) or
                                                 (isinstance(key, str) and key.isdigit())):
                    raise ValueError(f"block_recall_targets: expected block indices (integers >= 0) as keys, got {key!r}")
                out[int(key)] = val
            self.block_recall_targets = out
        self.validate()

    # ------------------------------------------------------------------ helpers
    def validate(self) -> None:
        def pos_int(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if allow_zero else 1):
                raise ValueError(f"{name}: expected an integer >= {0 if allow_zero else 1}, got {v!r}")

        def frac(name: str, lo: float = 0.0, hi: float = 1.0, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name}: expected a number, got {v!r}")
            if v > hi or v < lo or (lo_open and v == lo):
                raise ValueError(f"{name}: expected a value in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")

        for n in ("rank", "row_sample_stride", "train_every_stage1", "profile_every",
                  "profile_every_late", "switch_check_every", "group_size", "k_multiple", "recall_rows"):
            pos_int(n)
        for n in ("train_every_stage2", "profile_until", "min_stage1_steps"):
            pos_int(n, allow_zero=True)
        if len(self.cube) != 3 or any(c < 1 for c in self.cube):
            raise ValueError(f"cube: expected three positive integers (t, h, w), got {self.cube!r}")
        if len(self.predictor_betas) != 2:
            raise ValueError(f"predictor_betas: expected two numbers, got {self.predictor_betas!r}")
        frac("theta", lo_open=True)
        frac("ema_alpha", hi=1.0)
        frac("loss_ema_alpha")
        frac("min_density")
        frac("k_margin")
        frac("recall_target", lo_open=True)
        for i, t in (self.block_recall_targets or {}).items():
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or not 0 < t <= 1:
                raise ValueError(f"block_recall_targets: block {i}: expected a value in (0, 1], got {t!r}")
        frac("recall_max_density", lo_open=True)
        frac("recall_tolerance")
        if self.k_rule not in ("recall", "theta"):
            raise ValueError(f"k_rule: expected 'recall' or 'theta', got {self.k_rule!r}")
        kb = self.kv_block
        if isinstance(kb, bool) or not (kb == "auto" or (isinstance(kb, int) and kb in KV_BLOCKS)):
            raise ValueError(f"kv_block: expected one of {list(KV_BLOCKS)} or 'auto', got {kb!r}")
        if kb == "auto" and self.k_rule != "recall":
            raise ValueError("kv_block: 'auto' picks each head's granularity from the recall-versus-K "
                             f"curves and needs k_rule='recall', got k_rule={self.k_rule!r}")
        frac("dispatch_threshold")
        frac("dispatch_margin")
        frac("memory_fraction")
        frac("cos_weight", hi=float("inf"))
        frac("norm_weight", hi=float("inf"))
        frac("switch_loss", hi=float("inf"))
        if self.switch_rule not in ("loss", "dispatch"):
            raise ValueError(f"switch_rule: expected 'loss' or 'dispatch', got {self.switch_rule!r}")
        if self.switch_rule == "dispatch" and self.k_rule != "recall":
            raise ValueError("switch_rule: 'dispatch' switches on the recall rule's measured lists and needs "
                             f"k_rule='recall', got k_rule={self.k_rule!r}")
        frac("predictor_lr", hi=float("inf"))
        frac("finetune_lr", hi=float("inf"))
        frac("predictor_weight_decay", hi=float("inf"))
        if self.force_stage2_step is not None:
            pos_int("force_stage2_step", allow_zero=True)
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic: expected true, false or null, got {self.deterministic!r}")
        if self.dense_backend not in ("auto", "default"):
            raise ValueError(f"dense_backend: expected 'auto' or 'default', got {self.dense_backend!r}")

    @property
    def cube_volume(self) -> int:
        return self.cube[0] * self.cube[1] * self.cube[2]

    def profile_due(self, step: int) -> bool:
        """True when the profiler runs on this (0-based) training step."""
        if step < self.profile_until:
            return step % self.profile_every == 0
        return step % self.profile_every_late == 0

    def train_due(self, step: int, stage: int) -> bool:
        """True when the predictors train on this step in this stage."""
        every = self.train_every_stage1 if stage == 1 else self.train_every_stage2
        return every > 0 and step % every == 0

    def recall_target_of(self, block: int) -> float:
        """The recall rule's target for block ``block`` (block_recall_targets, else recall_target)."""
        return float((self.block_recall_targets or {}).get(block, self.recall_target))

    def head_k(self, sparsity: float, seq_len: int) -> int:
        """Per-head K = max(ceil((1 - s + margin) * S), ceil(min_density * S)), rounded up to a
        multiple of k_multiple, capped at S (and at least 1)."""
        dens = min(1.0, max(0.0, 1.0 - float(sparsity) + self.k_margin))
        k = max(math.ceil(dens * seq_len - 1e-9), math.ceil(self.min_density * seq_len - 1e-9), 1)
        k = -(-k // self.k_multiple) * self.k_multiple
        return int(min(k, seq_len))

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cube"] = list(self.cube)
        d["predictor_betas"] = list(self.predictor_betas)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DSVConfig":
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise TypeError(f"config: expected a mapping, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"config: unknown key(s) {bad}; valid keys: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str) -> "DSVConfig":
        """Load a config from a YAML file; the file may hold the keys at top level or under `dsv:`."""
        with open(path, "r") as f:
            data = yaml_load(f) or {}
        if isinstance(data, dict) and set(data) == {"dsv"}:
            data = data["dsv"] or {}
        return cls.from_dict(data)

    def replace(self, **kw: Any) -> "DSVConfig":
        return dataclasses.replace(self, **kw)


_YAML_LOADER = None


def yaml_load(stream):
    """``yaml.safe_load`` that also reads exponent numbers written without a dot (``1e-4``) as
    floats: YAML 1.1 would read them as strings, which surprises anyone writing a learning rate."""
    global _YAML_LOADER
    import re

    import yaml

    if _YAML_LOADER is None:
        class _Loader(yaml.SafeLoader):
            pass

        _Loader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
            list("-+0123456789"))
        _YAML_LOADER = _Loader
    try:
        return yaml.load(stream, Loader=_YAML_LOADER)
    except yaml.YAMLError as e:
        raise ValueError(yaml_error_line(e, getattr(stream, "name", None))) from None


def yaml_error_line(e, name=None) -> str:
    """One line for a YAML syntax error: ``<file>:<line>:<column>: invalid YAML: <problem>``."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = name if isinstance(name, str) else "<string>"
    if mark is not None:
        where += f":{mark.line + 1}:{mark.column + 1}"
    what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) \
        or str(e).splitlines()[0]
    return f"{where}: invalid YAML: {what}"


def _field_docs() -> Dict[str, str]:  # pragma: no cover - documentation helper
    """Attribute docstrings (the string literal after each field), for docs generation."""
    import ast
    import inspect

    src = inspect.getsource(DSVConfig)
    tree = ast.parse(src)
    out: Dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            out[a.target.id] = b.value.value  # type: ignore[attr-defined]
    return out
