"""Run under torchrun by test_torchrun.py: the demo config with overrides, ended after N optimizer steps without
an export, as a killed run ends (`python -m torch.distributed.run ... stop_after.py N --set key=value ...`)."""
import sys

import torch.distributed as dist

from novatune.train.config import load_with_base
from novatune.train.loop import train

if __name__ == "__main__":
    n, overrides = int(sys.argv[1]), [a for a in sys.argv[2:] if a != "--set"]
    cfg, base = load_with_base(None, overrides)
    train(cfg, base_dir=base, stop_after=n)
    dist.destroy_process_group()
