"""The reference application: a video Diffusion Transformer trained with flow matching, with DSV
sparse attention or full attention, built on the library (``dsv_ext``) and never imported by it.

Commands (``--help`` on each):

    python -m dsv_ext.app.train      --config configs/tiny.yaml      train (DSV, or --attention dense)
    python -m dsv_ext.app.compare    --config configs/tiny.yaml      full attention vs DSV (--seeds N)
    python -m dsv_ext.app.sample     --checkpoint RUN/ckpt_last.pt   sample videos from a checkpoint
    python -m dsv_ext.app.evaluate   --checkpoint RUN/ckpt_last.pt   paired quality evaluation
    python -m dsv_ext.app.checkpoint RUN/ckpt_last.pt                verify and describe a checkpoint

Modules: ``models`` (the DiT), ``data`` (procedural videos, video files, the patch encoder),
``common`` (config, model building, objective, validation set, device setup shared by the
commands), ``train``, ``sample``, ``compare`` (with ``seeds``: statistics over seeds, ``report``:
table formatting), ``evaluate``, ``checkpoint`` (atomic, checksummed files), ``cli`` (the
commands' shared error handling).
"""
