set -x
export GPUMEM_TORCH_LIB=$PWD/gpu-bundle/libgpumem_torch.so PYTHONPATH=$PWD/python/gpumem_torch
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for i in 1 2; do
  python3 python/gpumem_torch/tests/alloc_loop.py native 2>&1 | grep -v Warning
  python3 python/gpumem_torch/tests/alloc_loop.py gpumem 2>&1 | grep -v Warning
done > $OUT/alloc_loop.txt
cat $OUT/alloc_loop.txt
gpu-bundle/gpumem bench alloc --rounds 3 > $OUT/bench_alloc.txt 2>&1; cat $OUT/bench_alloc.txt
gpu-bundle/test-gpu --include-ignored --test-threads=1 > $OUT/test_gpu.txt 2>&1; tail -3 $OUT/test_gpu.txt
BENCH_STEP_STATS=1 timeout 200 python3 scripts/bench_torch.py --lockstep --groups 3 --workloads gptfix --settings native,gpumem --steps 30 --json $OUT/gptfix.json > $OUT/gptfix.txt 2>&1; tail -25 $OUT/gptfix.txt
