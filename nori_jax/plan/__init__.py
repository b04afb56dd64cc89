"""Capacity planning: the real scheduler in simulated time over a fitted step-time model.

`nori-jax plan calibrate` records step profiles on the engine and fits the model
(`calibration.py`); `plan simulate`, `plan sweep` and `plan size` replay a workload through the
engine core with a simulated executor (`simulator.py`). See docs/planning.md.
"""
