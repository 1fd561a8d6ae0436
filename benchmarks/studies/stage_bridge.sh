#!/usr/bin/env bash
# Run on the CPU machine, in the project's root: stage in ./.bridge (git-ignored) Megatron-Bridge 0.6.2 and the
# wheels its `pretrain` imports beyond the GPU image and .device (benchmarks/results/2026-11-21_h200x4/bridge.md),
# since nothing can be downloaded on the GPU machine; write .bridge/install.sh, which installs them there.
#   bash benchmarks/studies/stage_bridge.sh      # ~15 MB; idempotent (pip skips wheels already there)
# On the GPU machine, after `source .device/env.sh && bash .device/setup.sh`:   bash .bridge/install.sh
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
B="$ROOT/.bridge"; W="$B/wheels"
mkdir -p "$W"

# The GPU image: CPython 3.12 (glibc >= 2.31: nvidia-resiliency-ext 0.3.0 ships only a manylinux_2_31 wheel).
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# Pinned so that a restaged .bridge is what was checked. Built for cp312 (manylinux): nvidia-resiliency-ext, cffi,
# multi-storage-client, pulp, rapidyaml, rpds-py, xattr; multiprocess is a py312 wheel; the rest are pure Python.
PINS=(
  megatron-bridge==0.6.2
  # megatron-core 0.19's NVRx check reads nvidia_resiliency_ext.__version__: 0.4.1 is a namespace package without it
  nvidia-resiliency-ext==0.3.0
  # Bridge's config imports its energon builder (megatron-core[dev] pins: energon ~=7.0, msc ~=0.50, otel ~=1.43)
  megatron-energon==7.4.1 multi-storage-client==0.51.0 opentelemetry-api==1.43.0 xattr==1.3.0 cffi==2.1.1
  pycparser==3.12 lark==1.3.1 wcmatch==10.2.1 bracex==3.2.3 jsonschema==4.26.0 referencing==0.37.0
  rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 braceexpand==0.1.7 rapidyaml==0.15.2 deprecation==2.1.0
  filetype==1.2.0 webdataset==1.0.2
  # train.py, gpt_step.py, eval.py and checkpointing.py import modelopt; its searcher imports pulp. pulp 4.x (0.7 MB,
  # with orloge and cpsat-logutils) as in the earlier run, although modelopt 0.47 asks for pulp<4.0 (3.x ships CBC
  # binaries: 16 MB); only `import pulp` runs
  nvidia-modelopt==0.47.0 pulp==4.2.0 orloge==1.0.0 cpsat-logutils==1.0.0
  # Bridge's config imports its Hugging Face data source (the image has pyarrow, huggingface-hub, xxhash, pandas)
  datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1
)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$W" "${PINS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
n=$(ls "$W"/*.whl | wc -l)
[ "$n" -ge "${#PINS[@]}" ] || { echo "stage_bridge: $n wheels in $W, expected ${#PINS[@]}" >&2; exit 1; }

cat > "$B/install.sh" <<'EOF'
#!/usr/bin/env bash
# Written by benchmarks/studies/stage_bridge.sh. On the GPU machine, in the project's root, after
# `source .device/env.sh && bash .device/setup.sh` (TE, megatron-core): installs Megatron-Bridge 0.6.2 from the staged
# wheels (no index, no dependency resolution) and checks that its pretrain imports. ~1 s when already done here.
set -euo pipefail
W="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/wheels"
STAMP=/tmp/.bridge-install-$(ls "$W" | sha1sum | cut -c1-12)
[ -f "$STAMP" ] && exit 0
python3 -c "import megatron.core, transformer_engine.pytorch" 2>/dev/null \
  || { echo "bridge install: TE/megatron-core missing: run 'bash .device/setup.sh' first" >&2; exit 3; }
out=$(python3 -m pip install -q --no-index --no-deps --no-cache-dir "$W"/*.whl 2>&1) || { echo "$out" >&2; exit 1; }
echo "$out" | grep -vi warning || true
# no dependency resolution here: name any requirement the image's own packages miss (datasets 5.2 asks pyarrow >= 24)
python3 -m pip check 2>&1 | grep -iE "datasets|bridge|energon|modelopt|resiliency|storage" || true
python3 -c "import megatron.bridge; from megatron.bridge.training.pretrain import pretrain; \
print('megatron-bridge', megatron.bridge.__version__, 'ready')"
touch "$STAMP"
EOF
chmod +x "$B/install.sh"
du -sh "$B" | awk '{print "staged " $1 " in .bridge; carry [\".bridge\"] and run on the GPU machine, after .device/setup.sh: bash .bridge/install.sh"}'
