"""KV commit cost of HFTarget versus context length.

For each context length, prefill a random prompt into a tiny target, forward a random tree of
``--nodes`` nodes and time ``commit`` of an accepted path of ``--accept`` nodes that is NOT a chain
prefix (so entries really move). The commit gathers the accepted entries into place and slices the
rest off; its cost should not depend on the context length.

    python benchmarks/kv_commit.py --contexts 128,256,512,1024,2048 --nodes 64 --accept 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.tree import Tree
from bastion.testing.tiny import tiny_model


def branching_tree(n: int, accept: int, vocab: int) -> tuple[Tree, list[int]]:
    """A tree of n nodes whose accepted path (root + accept - 1 nodes) sits at the END of the node order."""
    side = n - accept  # side nodes first, all children of the root
    tokens, parents = [0], [-1]
    for i in range(side):
        tokens.append(3 + i % (vocab - 3))
        parents.append(0)
    prev = 0
    for d in range(accept - 1):
        tokens.append(vocab - 1 - d)
        parents.append(prev)
        prev = len(tokens) - 1
    path = [0] + list(range(side + 1, n))
    return Tree.from_parents(tokens, parents), path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="128,256,512,1024,2048")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--accept", type=int, default=6, help="accepted nodes, root included")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_model("qwen3", seed=0, max_position_embeddings=4096)
    target = HFTarget(model)
    tree, path = branching_tree(args.nodes, args.accept, 256)
    nodes = torch.tensor(path)
    print(f"tree {args.nodes} nodes, accepted path {args.accept} nodes (moved), {args.repeats} repeats")
    print(f"{'context':>8} {'commit median us':>17} {'commit p90 us':>14} {'cache MB':>9}")
    for ctx in [int(c) for c in args.contexts.split(",")]:
        prompt = torch.randint(3, 256, (1, ctx))
        times = []
        for _ in range(args.repeats):
            target.prefill(prompt)  # same context every repeat (untimed)
            target.forward_tree(tree)
            t0 = time.perf_counter()
            target.commit(nodes)
            times.append(time.perf_counter() - t0)
        cache_mb = sum(layer.keys.numel() + layer.values.numel() for layer in target.cache.layers) * 4 / 2**20
        times.sort()
        print(f"{ctx:>8} {statistics.median(times) * 1e6:>17.1f} {times[int(0.9 * len(times))] * 1e6:>14.1f} {cache_mb:>9.2f}")


if __name__ == "__main__":
    main()
