"""DSV attention modules (layer 3): SparseAttention, DSVAttention, DenseAttention, the predictors,
and the typed driver contract (StepPlan, ModuleStats, Workload)."""
from .attention import DenseAttention, DSVAttention, RMSNorm, SparseAttention, set_index_refresh
from .contract import ModuleStats, StepPlan, Workload
from .predictor import LowRankPredictor

__all__ = ["SparseAttention", "DSVAttention", "DenseAttention", "RMSNorm", "set_index_refresh", "LowRankPredictor",
           "StepPlan", "ModuleStats", "Workload"]
