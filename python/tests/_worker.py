"""One rank of a multi-process test: `python _worker.py SCENARIO [ARGS...]`.
Creates the communicator from the environment (unless the scenario makes
its own), runs `scenarios.SCENARIO`, and exits 0 only if it returned."""

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios  # noqa: E402


def main() -> int:
    name, args = sys.argv[1], sys.argv[2:]
    fn = getattr(scenarios, name)
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    print(f"rank ok: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
