"""Drivers of the DSV modules (layer 4): DSVController (controller.py) and the sparse/dense
dispatcher with its calibration tables (dispatch.py, calibration/; ``python -m
dsv_ext.control.dispatch`` measures a table)."""
