"""One rank of a GPU test: `python _gpu_worker.py SCENARIO` under torchrun
(or with RANK/WORLD_SIZE/MASTER_PORT set by the test for scenarios that
make their own store). Exits 0 only if the scenario returned."""

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_scenarios  # noqa: E402


def main() -> int:
    name = sys.argv[1]
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
