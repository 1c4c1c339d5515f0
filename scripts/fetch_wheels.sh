#!/usr/bin/env bash
# The wheels the GPU machine lacks for the GPU suite and the peers, into .whl/ (git-ignored), for CPython 3.12
# x86-64; scripts/gpu_check.sh installs whatever .whl/ holds. The versions are the ones the recorded GPU rows ran.
#   scripts/fetch_wheels.sh           liger-kernel, trl + datasets (+ dill, multiprocess), nvidia-cudnn-frontend
#   WITH_BNB=1 scripts/fetch_wheels.sh  bitsandbytes too (QLoRA tests; 40+ MB of the 64 MiB a device call carries)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  plat+=(--platform "$p")
done
wheels=(liger-kernel==0.8.5 trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 nvidia-cudnn-frontend==1.32.0)
[ "${WITH_BNB:-0}" = 1 ] && wheels+=(bitsandbytes==0.50.2)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl "${wheels[@]}"
du -ch .whl/*.whl | tail -n 1
