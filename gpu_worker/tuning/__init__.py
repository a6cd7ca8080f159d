"""Calibration and tuning: measure the model on this device (calibrate.py), keep what was
measured as a profile (profile.py), and apply it when a worker starts (apply.py)."""
