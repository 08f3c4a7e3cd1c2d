"""DSVController: predictor training, profiling, stage switching and op dispatch.

PUBLIC API (stable; implementation in progress below)
------------------------------------------------------
class DSVController:
    DSVController(model: nn.Module, config: DSVConfig | str | dict | None = None,
                  dispatcher: Dispatcher | None = None)
        Finds every SparseAttention in `model` (after dsv_ext.convert or DSVAttention layers),
        creates an AdamW over their predictors and arms step 0 (predictor training + profile).
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
    state_dict() -> dict; load_state_dict(sd) -> None
        round-trip step, stage, EMAs, predictors and optimizer (a resumed run continues in the
        same stage with identical next steps).
    switch_to_stage2() -> None      # manual switch (also via config.force_stage2_step)
"""
