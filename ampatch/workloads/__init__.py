"""Built-in training workloads for ``ampatch compare``.

Each module (``lm``, ``cnn``, ``lstm``) is a small but complete amp training script,
runnable as ``python -m ampatch.workloads.<name> --steps N --seed S --opt-level O1``.
They use data that ships with the package (``data/corpus.txt``: original English text
written for ampatch, dedicated to the public domain under CC0) or data generated from the
seed, so the same seed gives the same initial weights and batches at every opt level.
"""

WORKLOADS = ("lm", "cnn", "lstm")
DEFAULT_WORKLOAD = "lm"
# Here rather than in each module so the command line can read them without importing torch.
DEFAULT_STEPS = {"lm": 150, "cnn": 150, "lstm": 150}
