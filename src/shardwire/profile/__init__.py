"""Where a step's time went: spans, interval arithmetic, FLOPs and MFU."""

# What a profiled run writes into its run directory: named here, where the torch-free readers of a
# profile (the simulator's calibration) find them without importing the profiler.
PROFILE_FILE, TRACE_FILE = "profile.json", "trace.json"
# The version of the profile's format, which its readers check.
FORMAT_VERSION = 1
