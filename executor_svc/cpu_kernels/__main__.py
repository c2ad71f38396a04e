"""Build the executor's C++ CPU kernels now (make setup): exit 0 when they load, 1 when not."""

import sys

from executor_svc.cpu_kernels import load

module = load()
print("cpu kernels:", "built" if module is not None else "UNAVAILABLE", file=sys.stderr)
sys.exit(0 if module is not None else 1)
