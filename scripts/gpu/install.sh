#!/usr/bin/env bash
# Installs MLX's CUDA wheels into /tmp/site on the lent GPU machine (after the call that carried
# .whlA into /root/stash; this call carries .whlB), unless `import mlx.core` already works there,
# and makes /tmp/site a site directory (so `--use-bricks` works in mlx-lm's own CLIs as after
# `pip install`). Source it: it exports PYTHONPATH. ../shared/docs/device.md.
if ! PYTHONPATH=/tmp/site python3 -c "import mlx.core" 2>/dev/null; then
  cp .whlB/* /root/stash/
  (cd /root/stash && cat part_* > "$(cat NAME)" && python3 -m pip install -q --no-index --no-deps \
     --no-compile --target /tmp/site ./mlx_cuda_13-*.whl ./mlx-*.whl ./mlx_lm-*.whl) || return 3
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "from mlx_bricks.entry.hook import PTH_LINE, PTH_NAME
open('/tmp/site/' + PTH_NAME, 'w').write(PTH_LINE)"
echo "import site; site.addsitedir('/tmp/site')" > /tmp/site/sitecustomize.py
python3 -c "import mlx.core as mx
print('cuda:', mx.cuda.is_available(), mx.device_info().get('device_name'))"
