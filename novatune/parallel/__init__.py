"""Several processes, one run: the process group (dist.py), the model wrapped for FSDP2 or DDP (wrap.py) and the
torchrun launcher behind `novatune train --nproc N` (launch.py). This package sits below train/: it knows torch
and modules, not configs' meaning beyond the parallel section, and never imports train/."""
