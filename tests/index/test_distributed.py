"""Two processes under torch.distributed (gloo), each loading one shard: every rank returns the single-process
result, ties and filters included."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lik

from .helpers import grid_docs, grid_queries

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        index = lik.Index.load(path, shard=rank, num_shards=world, placement="host", device="cpu", chunk_tokens=4)
        Q = grid_queries(torch.Generator().manual_seed(5))
        results = {
            "all": index.search(Q, 7),
            "single_query": index.search(Q[0], 3),
            "filtered": index.search(Q, 3, doc_ids=[9, 1, 0, 8]),
            "filter_on_one_rank": index.search(Q, 2, doc_ids=[0, 2]),
            "k0": index.search(Q, 0),
            "every_doc": index.search(Q, len(index)),
        }
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process(tmp_path):
    docs = grid_docs(torch.Generator().manual_seed(11))
    # Many equal documents: ties across the rank boundary must still go to the lower id.
    docs[6] = docs[1] = docs[8] = docs[3].clone()
    index = lik.Index.build(docs, dtype=torch.float32, shard_tokens=5, progress=False)
    index.save(tmp_path / "ix", progress=False)
    single = lik.Index.load(tmp_path / "ix", placement="host", device="cpu")
    Q = grid_queries(torch.Generator().manual_seed(5))
    expected = {
        "all": single.search(Q, 7),
        "single_query": single.search(Q[0], 3),
        "filtered": single.search(Q, 3, doc_ids=[9, 1, 0, 8]),
        "filter_on_one_rank": single.search(Q, 2, doc_ids=[0, 2]),
        "k0": single.search(Q, 0),
        "every_doc": single.search(Q, len(docs)),
    }
    mp.spawn(rank_main, args=(WORLD, free_port(), str(tmp_path / "ix"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, (scores, ids) in expected.items():
            assert torch.equal(got[name][1], ids), (rank, name)
            assert torch.equal(got[name][0], scores), (rank, name)
