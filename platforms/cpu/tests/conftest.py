"""The CPU platform's own tests (``pytest platforms/cpu/tests``)."""
import os

# Two cores shared by everything: OpenMP threads that spin while waiting starve the other process.
# Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
