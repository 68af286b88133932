"""``mlx_lm.server`` with the bricks and one kernel source broken (appended text that is not
MSL): the first-call guard test of tests/test_server.py runs the server through this script.

Usage: ``python tests/server_with_fault.py KERNEL_FILE [mlx_lm.server flags]``, e.g.
``gemm.metal --use-bricks --bricks-backend emulator --model DIR``.
"""
import sys

from mlx_bricks import kernels
from mlx_bricks.entry.session import run_command

BROKEN = sys.argv.pop(1)
_read_source = kernels.read_source


def _broken(filename, package=kernels.SOURCE_PACKAGE):
    text = _read_source(filename, package)
    return text + "\n this is not Metal ;\n" if filename == BROKEN else text


kernels.read_source = _broken

if __name__ == "__main__":
    sys.exit(run_command("server"))
