"""The host's part of one forward on the static cache with CUDA graphs: what a replayed forward costs besides the
replay (making its inputs, the copies in and out, the session's Python), measured on a CPU with the graph's
replay stood in for by a call that does nothing (issue 51).

On a GPU every torch call here other than a view is a kernel launch or a copy of its own, a few microseconds of
the host's time each, paid while the device waits for the forward to start (a greedy forward's ids are read
before the next forward is made). So this program reports, per forward of 1 token (a drafter's step, non-SI) and
of ``--tokens`` (a verification), greedy: the host's time (median of ``--repeats`` batches of ``--batch``) and
the torch calls made outside the replay, by name. The model is one layer of width 32 with the vocabulary of
``--vocab`` ids (its forward is never timed: the stand-in replays nothing); the greedy ids read out come from the
graph's buffer. And a draft tree's verification: the torch calls it makes outside the model's forward (views
aside) for models of 2, 6 and 48 layers (calls that grow with the layers are work in every layer).

    python benchmarks/forward_host_cost.py                 # this checkout
    PYTHONPATH=<another checkout>/src python benchmarks/forward_host_cost.py   # another commit's code, to compare
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from _common import add_options, emit, parse, shrink
from tests.torch_calls import TorchCalls

PREFIX = 128


def stand_in_graphs(torch) -> None:
    """torch.cuda's graph calls as a CPU stands in for them: a capture records nothing, a replay does nothing."""

    class Graph:
        def replay(self) -> None:
            pass

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        yield

    torch.cuda.CUDAGraph = Graph
    torch.cuda.graph = graph
    torch.cuda.graph_pool_handle = lambda: None
    torch.cuda.current_stream = lambda device=None: type("Stream", (), {"synchronize": lambda self: None})()


def measure(vocab: int, tokens: int, repeats: int, batch: int) -> dict:
    import torch
    import transformers

    from dsi.models.hf import forward_plan as hf_static
    from dsi.models.base import extend_rows
    from dsi.models.hf.model import HFModel
    from dsi.models.hf.forward_plan import ForwardPlan

    torch.set_num_threads(1)
    stand_in_graphs(torch)
    if hasattr(hf_static, "capturable"):  # this checkout's: graphs on the CPU's buffers
        hf_static.capturable = lambda device: True
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = HFModel(transformers.LlamaForCausalLM(config).eval(), name="host-cost",
                    forward_plan=ForwardPlan("static", cuda_graphs=True))
    session = model.new_session()
    session._graphs.disabled = False  # before capturable existed, graphs were refused off CUDA here
    extend_rows(session, [(7 * i + 3) % vocab for i in range(PREFIX)], None, 1, greedy=True)
    rows = {}
    for n in (1, tokens):
        new = [(5 * i + 1) % vocab for i in range(n)]

        def forward(new=new):
            extend_rows(session, new, None, 1, greedy=True)
            session.truncate(PREFIX)

        forward()  # the capture (stood in for)
        with TorchCalls() as counted:
            forward()
        calls = counted.calls
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(batch):
                forward()
            times.append((time.perf_counter() - start) / batch)
        rows[str(n)] = {"host_us": 1e6 * statistics.median(times), "torch_calls": len(calls), "calls": calls}
    assert session._graphs.captures >= 2, "the stand-in graphs were not used"
    return rows


def tree_calls(layers: tuple[int, ...]) -> dict:
    """Per KV cache (dynamic, static), for models of each of ``layers`` layers: the torch calls, views aside, one
    draft tree's verification (6 nodes, main path 0, 3, 5, after 2 new prefix tokens) makes outside the model's
    forward: what the session does around its one forward."""
    import torch
    import transformers

    from dsi.models.base import forward_rows, tree_rows
    from dsi.models.hf.model import HFModel
    from dsi.models.hf.forward_plan import ForwardPlan
    from dsi.trees import ROOT, DraftTree

    tree = DraftTree((2, 7, 9, 6, 8, 3), (ROOT, ROOT, ROOT, 0, 0, 3))
    prefix = [3, 1, 4, 1, 5]
    out: dict = {}
    for cache in ("dynamic", "static"):
        counts = {}
        for n in layers:
            torch.manual_seed(0)
            config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64)
            raw = transformers.LlamaForCausalLM(config).eval()
            session = HFModel(raw, forward_plan=ForwardPlan(cache)).new_session()
            forward_rows(session, prefix[:3], 1)
            with TorchCalls(outside=raw) as calls:
                tree_rows(session, prefix, tree)
            counts[str(n)] = len(calls.work())
        out[cache] = counts
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936, help="the rows' ids (default: Qwen2.5's 151,936)")
    parser.add_argument("--tokens", type=int, default=5, help="a verification's tokens (default 5: k = 4)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=500, help="forwards timed together (default 500)")
    add_options(parser, "a vocabulary of 1,000 ids, 2 repeats of 20 forwards")
    args = parse(parser)
    shrink(args, vocab=1000, repeats=2, batch=20)
    trees = tree_calls((2, 6) if args.dry_run else (2, 6, 48))
    rows = measure(args.vocab, args.tokens, args.repeats, args.batch)
    print(f"host's part of a replayed greedy forward (vocabulary {args.vocab}; median of {args.repeats} x "
          f"{args.batch}):")
    print("| tokens | host us | torch calls | calls |")
    print("|---|---|---|---|")
    for n, row in rows.items():
        print(f"| {n} | {row['host_us']:.1f} | {row['torch_calls']} | {' '.join(row['calls'])} |")
    print("\na draft tree's verification (6 nodes): torch calls outside the model's forward, views aside, by layers:")
    for cache, counts in trees.items():
        print(f"| {cache} cache | " + " | ".join(f"{n} layers: {c}" for n, c in counts.items()) + " |")
    emit({"benchmark": "forward_host_cost", "vocab": args.vocab, "tokens": args.tokens, "prefix": PREFIX,
          "repeats": args.repeats, "batch": args.batch, "rows": rows, "tree_calls": trees}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
