"""One rank of a GPU test: `python _gpu_worker.py SCENARIO` under torchrun
(or with RANK/WORLD_SIZE/MASTER_PORT set by the test for scenarios that
make their own store). Exits 0 only if the scenario returned."""

import faulthandler
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_scenarios  # noqa: E402


def main() -> int:
    name = sys.argv[1]
    # A rank still running after this long prints every thread's Python
    # stack (the test's own timeout then stops it), so a hang names its call.
    faulthandler.dump_traceback_later(float(os.environ.get("FERROCOMM_PY_HANG_DUMP_S", "45")), exit=False)
    try:
        getattr(gpu_scenarios, name)(*sys.argv[2:])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    print(f"rank ok: {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
