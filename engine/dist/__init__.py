"""ds4.engine.dist: DeepSeek V4 over several ranks (expert parallelism, torch.distributed).

Routed experts of every layer are split across ranks (rank r owns a contiguous slice and reads only
its bytes from the GGUF); attention, the shared expert, hyper-connections and the head are
replicated; the partial MoE outputs are summed with one all-reduce per layer (NCCL on GPUs with
NVLink multicast off, gloo on the CPU). Rank 0 exposes the usual Session API.

    ds4-dist -m model.gguf --nproc 4 --device cuda -p "Hello"           # or python -m ds4.engine.dist.launch
    from ds4.engine.dist.launch import run; run(program, 4, "model.gguf", device="cuda")

Modules: shard (expert ranges, byte-range reads, ShardedWeights), comm (combine strategies and
their accounting), session (DistSession, the rank loop), launch (spawn, ds4-dist), floors
(memory per rank and bandwidth floors). See README.md in this folder for figures and owed runs.
"""
