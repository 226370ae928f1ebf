"""What a device can do, as numbers: `DeviceProfile` (peak FLOP/s per dtype, memory
bandwidth and size, link bandwidths, kernel efficiencies; `profile.py`) and the built-in
profiles with the TOML device files (`catalog.py`: `load_device`).

Both the Auto Search's cost model and the training application's telemetry (MFU against a
device's peak) read them, so they sit below both.
"""
