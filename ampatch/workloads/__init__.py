"""Built-in training workloads for ``ampatch compare``.

Each module (``lm``, ``cnn``, ``lstm``) is a small but complete amp training script,
runnable as ``python -m ampatch.workloads.<name> --steps N --seed S --opt-level O1 --size S``.
They use data that ships with the package (``data/corpus.txt``: original English text
written for ampatch, dedicated to the public domain under CC0) or data generated from the
seed, so the same seed gives the same initial weights and batches at every opt level.

Each comes in the sizes of ``SIZES`` (its module's ``SIZES`` table gives the dimensions), each
about four times the compute of the one before; ``ampatch compare`` times a few steps to pick
the largest that fits its time budget (``ampatch.workloads.calibrate``).
"""

WORKLOADS = ("lm", "cnn", "lstm")
DEFAULT_WORKLOAD = "lm"
# Here rather than in each module so the command line can read them without importing torch.
DEFAULT_STEPS = {"lm": 150, "cnn": 150, "lstm": 150}
SIZES = ("tiny", "small", "medium", "large", "huge")  # smallest first
MIN_STEPS = 3  # a run's --deadline never stops it before this many steps
DEFAULT_SIZE = "large"  # a workload run by hand: the dimensions it had before it had sizes
