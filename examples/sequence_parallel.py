"""Two-rank sequence-parallel attention over gloo (docs/sequence-parallel.md).

    torchrun --nproc-per-node 2 examples/sequence_parallel.py
    python examples/sequence_parallel.py      # starts its two ranks itself

1001 tokens (not divisible by 2), causal, Ulysses then ring: every rank's output
shard, gathered, matches one process's SDPA.
"""

import os
import socket
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import attnres


def rank_main() -> None:
    """One rank; torchrun's environment (RANK, WORLD_SIZE, MASTER_*) says which."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same full tensors on both ranks, for the check
    q, k, v = (torch.randn(1, 1001, 8, 64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    for layout in ({"ulysses": 2}, {"ring": 2}):
        sp = attnres.SequenceParallel(**layout, timeout=30)  # the default group: 2 ranks
        attn = attnres.Attention(8, 64, dtype="float32", causal=True, parallel=sp)
        out = attn(sp.shard(q), sp.shard(k), sp.shard(v))  # 501 tokens on rank 0, 500 on 1
        error = (sp.gather(out) - expected).abs().max().item()
        assert error < 1e-4, error
        print(f"rank {rank} {layout}: {attn.backend.name}, {out.shape[1]} tokens, "
              f"max error {error:.1e}")  # fmt: skip
    dist.destroy_process_group()


def launch(world: int = 2) -> int:
    """Start ``world`` ranks of this script, as torchrun would; their worst exit code."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    ranks = [
        subprocess.Popen([sys.executable, __file__], env={**env, "RANK": str(r)})
        for r in range(world)
    ]
    codes = []
    for proc in ranks:
        try:
            codes.append(proc.wait(timeout=240))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return max(codes, key=abs)


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_main()
    else:
        sys.exit(launch())
