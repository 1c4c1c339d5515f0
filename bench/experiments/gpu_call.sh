#!/bin/bash
# one device call: install the carried wheels, then run the given commands with the repo importable
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
export NOVATUNE_GIT_SHA=${SHA:-unknown}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
