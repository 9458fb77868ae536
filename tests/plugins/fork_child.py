"""A stand-in worker for tests/launch/test_forkserver.py: reports what it was given, then exits as told."""

import json
import os
import sys
import time

if __name__ == "__main__":
    out = os.environ.get("FORK_CHILD_OUT")
    if out:
        with open(out, "w") as f:
            torch = sys.modules.get("torch")
            threads = torch.get_num_threads() if torch is not None else None
            json.dump({"env": os.environ.get("FORK_CHILD_EXIT"), "sid": os.getsid(0), "threads": threads}, f)
    print("printed by the child", flush=True)
    time.sleep(float(os.environ.get("FORK_CHILD_SLEEP", "0")))
    sys.exit(int(os.environ.get("FORK_CHILD_EXIT", "0")))
