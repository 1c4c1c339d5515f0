"""Run under torchrun by test_torchrun.py: the demo config with overrides, ended after N optimizer steps without
an export, as a killed run ends (`python -m torch.distributed.run ... stop_after.py N --set key=value ...`)."""
import gc
import sys

from novatune.parallel.dist import teardown
from novatune.train.config import load_with_base
from novatune.train.loop import train

if __name__ == "__main__":
    n, overrides = int(sys.argv[1]), [a for a in sys.argv[2:] if a != "--set"]
    cfg, base = load_with_base(None, overrides)
    result = train(cfg, base_dir=base, stop_after=n)
    d = result.session.dist
    # leave as `novatune train` does (commands/cli.py: cmd_train): the wrapped model goes first, then every rank
    # leaves the group together. A rank that destroys its gloo group while the other still holds the model's
    # last gloo work can abort that one at exit ("terminate called without an active exception").
    del result
    gc.collect()
    teardown(d)
