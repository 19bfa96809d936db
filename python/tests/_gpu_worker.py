"""One rank of a GPU test: `python _gpu_worker.py SCENARIO [ARGS...]` under
torchrun (or with RANK/WORLD_SIZE/MASTER_PORT set by the test for scenarios
that make their own store). SCENARIO is a function of gpu_scenarios, or
`module:function` for another module beside this file. Exits 0 only if
the scenario returned."""

import faulthandler
import importlib
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    name = sys.argv[1]
    # A rank still running after this long prints every thread's Python
    # stack (the test's own timeout then stops it), so a hang names its call.
    faulthandler.dump_traceback_later(float(os.environ.get("FERROCOMM_PY_HANG_DUMP_S", "45")), exit=False)
    try:
        module, _, function = name.rpartition(":")
        getattr(importlib.import_module(module or "gpu_scenarios"), function)(*sys.argv[2:])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    print(f"rank ok: {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
