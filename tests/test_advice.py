"""Advice rules and the trust figures: pure functions on hand-made node tables."""

from __future__ import annotations

from fxprof_lightning.analysis.advice import (
    advise,
    elementwise_share,
    heavy_backward,
    low_peak,
    memory_bound,
    overhead_bound,
    regressed,
    slow_rank,
    whole_step,
)
from fxprof_lightning.analysis.regressions import Regression
from fxprof_lightning.analysis.trust import distortion
from fxprof_lightning.report import NodeStats, cpu_per_wall, step_spread


def node(name: str, fwd: float, bwd: float = 0.0, **extra) -> NodeStats:
    """A node timed over 3 calls: ``fwd``/``bwd`` ms per call."""
    fields = dict(name=name, op="call_module", target="Linear", module_path=name, calls=3, mean_ms=fwd,
                  median_ms=fwd, min_ms=fwd, max_ms=fwd, total_ms=3 * fwd, pct=0.0, bwd_calls=3 if bwd else 0,
                  bwd_mean_ms=bwd, bwd_median_ms=bwd, bwd_total_ms=3 * bwd)
    fields.update(extra)
    return NodeStats(**fields)


def test_low_peak_names_a_large_slow_matmul_only():
    slow = node("fc1", 4.0, 8.0, fwd_flops=10**9, pct_of_peak=6.0, intensity=40.0, bound="compute", fwd_gflops_per_s=250.0)
    fast = node("fc2", 4.0, 8.0, fwd_flops=10**9, pct_of_peak=70.0, intensity=40.0, bound="compute")
    tiny = node("fc3", 0.01, 0.02, fwd_flops=10**6, pct_of_peak=1.0, intensity=2.0, bound="memory")
    found = low_peak([slow, fast, tiny])
    assert len(found) == 1
    assert "`fc1`" in found[0].text and "6% of what the device allows" in found[0].text and "compute-bound" in found[0].text


def test_an_overhead_bound_node_is_told_so_not_called_compute_bound():
    """A 64-wide Linear taking 40 us for 0.2 us of work: the advice names per-op overhead and what helps, never
    'compute-bound' or 'a larger a larger batch'."""
    fc1 = node("fc1", 0.04, 0.08, fwd_flops=65_536, pct_of_peak=0.5, intensity=3.0, bound="overhead")
    other = node("fc2", 0.04, 0.08, fwd_flops=10**6, pct_of_peak=60.0, intensity=3.0, bound="memory")
    (found,) = overhead_bound([fc1, other])
    assert "`fc1`" in found.text and "fixed cost of each op" in found.text and "reduce-overhead" in found.text
    assert low_peak([fc1, other]) == []
    assert not any("compute-bound" in line or "a larger a larger" in line for line in advise([fc1, other]))


def test_whole_step_says_what_the_step_waits_for_first():
    data_bound = {"data": 60.0, "training_step": 20.0, "backward": 15.0, "optimizer": 5.0}
    (found,) = whole_step(data_bound)
    assert found.text.startswith("The step waits for its next batch 60% of the time")
    slow = node("fc1", 4.0, 8.0, fwd_flops=10**9, pct_of_peak=6.0, intensity=40.0, bound="compute", fwd_gflops_per_s=250.0)
    advice = advise([slow], phases=data_bound)
    assert advice[0].startswith("The step waits") and not any("fc1" in line for line in advice)  # not what it waits for
    optimizer_bound = {"data": 1.0, "training_step": 30.0, "backward": 30.0, "optimizer": 39.0}
    assert advise([slow], phases=optimizer_bound)[0].startswith("The step spends 39% of its time in the optimizer")
    assert any("fc1" in line for line in advise([slow], phases=optimizer_bound))  # the model is 60%: layers too


def test_heavy_backward_needs_a_large_ratio_and_share():
    heavy = node("emb", 1.0, 5.0)
    normal = node("fc", 1.0, 2.0)
    found = heavy_backward([heavy, normal])
    assert [a.text.split("`")[1] for a in found] == ["emb"]
    assert "5.0x as long in backward" in found[0].text


def test_elementwise_share_groups_flopless_nodes_by_module():
    nodes = [node("matmul", 2.0, 4.0, fwd_flops=10**8, op="call_function", module_path="block"),
             *(node(f"add_{i}", 0.5, 0.5, op="call_function", module_path="block", fwd_flops=0) for i in range(4)),
             node("relu", 0.01, 0.01, op="call_function", module_path="head", fwd_flops=0)]
    found = elementwise_share(nodes)
    assert len(found) == 1 and "4 elementwise nodes of `block`" in found[0].text


def test_elementwise_share_leaves_views_out():
    """Transposes, views and reshapes read and write nothing: they are not counted as elementwise work to fuse."""
    views = [node(f"attn_{op}", 0.5, 0.5, op="call_method", target=op, module_path="attn", fwd_flops=0)
             for op in ("transpose", "view", "transpose_1", "reshape", "permute")]
    assert elementwise_share(views) == []
    mixed = [*views, *(node(f"attn_{op}", 0.5, 0.5, op="call_function", target=f"torch.{op}", module_path="attn",
                            fwd_flops=0) for op in ("softmax", "mul"))]
    (found,) = elementwise_share(mixed)
    assert "2 elementwise nodes of `attn` (`attn_softmax`, `attn_mul`)" in found.text


def test_slow_rank_needs_the_same_rank_in_most_cycles_and_a_material_margin():
    on_rank = [[node("fc", 1.0, slowest_rank=1, slowest_rank_ms=1.3)], [node("fc", 1.0, slowest_rank=1, slowest_rank_ms=1.3)],
               [node("fc", 1.0, slowest_rank=0, slowest_rank_ms=1.3)], [node("fc", 1.0, slowest_rank=1, slowest_rank_ms=1.3)]]
    assert "Rank 1 was the slowest in 3 of 4 cycles" in slow_rank(on_rank, ranks=2)[0].text
    assert slow_rank(on_rank, ranks=1) == []
    alternating = [[node("fc", 1.0, slowest_rank=i % 2, slowest_rank_ms=1.3)] for i in range(4)]
    assert slow_rank(alternating, ranks=2) == []
    noise = [[node("fc", 1.0, slowest_rank=1, slowest_rank_ms=1.05)]] * 4  # the same rank, 5% behind: noise
    assert slow_rank(noise, ranks=2) == []


def test_regressed_and_advise_order_by_what_is_at_stake():
    regression = Regression("fc1", "forward", 1.0, 1.3, 1.3, 0.02)
    assert "`fc1` forward got 1.30x slower" in regressed([regression])[0].text
    nodes = [node("emb", 1.0, 5.0)]  # 100% of node time, 5x backward
    texts = advise(nodes, history=[nodes], regressions=[regression])
    assert len(texts) == 2 and texts[0].startswith("`emb`")
    assert advise([node("fc", 1.0, 2.0)]) == []  # nothing worth saying


def test_trust_figures():
    assert step_spread([10.0]) is None
    assert abs(step_spread([10.0, 12.0, 11.0]) - 2 / 11) < 1e-12
    assert cpu_per_wall([10.0, 10.0], [15.0, 25.0]) == 2.0
    assert distortion([10.0, 10.4, 10.2], [10.0, 10.3]) is None
    assert "spread" in distortion([10.0, 40.0, 10.2], [])
    # A 3x step with every node ~3x slower is load; with the nodes as before, it is the regression of a few nodes.
    assert "3.0x the earlier cycles'" in distortion([30.0, 30.2, 30.1], [10.0, 10.1], shared=2.8)
    assert distortion([30.0, 30.2, 30.1], [10.0, 10.1], shared=1.05) is None
    # The process waited for cores (CPU per wall 0.65 where it had 1.98) and every node ran 1.7x slower: load.
    assert "waited for cores" in distortion([17.0, 17.2, 17.1], [10.0], shared=1.7, cpu=0.65, earlier_cpu=[1.98])
    assert distortion([17.0, 17.2, 17.1], [10.0], shared=1.1, cpu=0.65, earlier_cpu=[1.98]) is None


def test_a_python_loop_over_rows_is_told_apart_from_an_unfused_chain():
    rows = [node(f"loop_getitem_{i}", 0.01, op="call_function") for i in range(40)]
    rows += [node(f"loop_mul_{i}", 0.01, op="call_function", module_path="loop") for i in range(40)]
    rows = [NodeStats(**{**n.__dict__, "module_path": "loop"}) for n in rows]
    (loop,) = elementwise_share(rows)
    assert "Python loop over rows" in loop.text and "Vectorise" in loop.text and "fusing" not in loop.text
    chain = [NodeStats(**{**node(f"sin_{i}", 0.1, op="call_function").__dict__, "module_path": "act"}) for i in range(18)]
    (fused,) = elementwise_share(chain)
    assert "fusing them" in fused.text


def test_a_memory_bound_matmul_is_told_to_take_a_larger_batch_before_its_heavy_backward():
    """Linear(4096, 4096) on a batch of 2: 1 FLOP per byte, at 37% of the memory roof, backward 5x its forward."""
    fc = node("fc", 4.2, 22.0, fwd_flops=2 * 2 * 4096 * 4096, intensity=1.0, bound="memory", pct_of_peak=37.0,
              fwd_gbytes_per_s=16.0)
    (found,) = memory_bound([fc])
    assert "memory-bound" in found.text and "larger batch" in found.text
    advice = advise([fc])
    assert advice[0] == found.text and "backward" in advice[1]
    assert memory_bound([node("fc", 4.2, 8.0, fwd_flops=10**9, intensity=1.0, bound="memory", pct_of_peak=5.0)]) == []


def test_a_dense_embedding_gradient_is_told_to_go_sparse():
    """A FLOP-less node whose inputs hold 100x what it writes (a table lookup) with a heavy backward: sparse=True.
    The same ratio on a node that computes is not a lookup."""
    table = node("emb", 0.04, 12.0, fwd_flops=0, fwd_bytes=12_800_000, out_bytes=2048)
    matmul = node("proj", 0.04, 12.0, fwd_flops=10_000, fwd_bytes=12_800_000, out_bytes=2048)
    (lookup,), (other,) = heavy_backward([table]), heavy_backward([matmul])
    assert lookup.text.startswith("`emb`") and "sparse=True" in lookup.text and "12.8 MB" in lookup.text
    assert "sparse" not in other.text and "gradients nobody needs" in other.text


def test_an_optimizer_step_made_large_by_a_dense_embedding_names_the_table():
    table = node("emb", 0.04, 12.0, fwd_flops=0, fwd_bytes=12_800_000, out_bytes=2048)
    phases = {"training_step": 1.0, "backward": 12.0, "optimizer": 8.0}
    (first,) = whole_step(phases, [table])
    assert "optimizer step" in first.text and "`emb`" in first.text and "sparse=True" in first.text
    (plain,) = whole_step(phases, [node("fc", 1.0, 2.0)])
    assert "sparse" not in plain.text


def test_slow_rank_names_where_that_rank_falls_behind():
    cycle = [node("fc", 1.0, slowest_rank=1, slowest_rank_ms=1.1), node("heavy", 2.0, slowest_rank=1, slowest_rank_ms=3.5),
             node("head", 0.5, slowest_rank=0, slowest_rank_ms=2.0)]
    (found,) = slow_rank([cycle] * 3, ranks=2)
    assert "Rank 1 was the slowest in 3 of 3 cycles, most in `heavy` (3.500 ms per call on rank 1" in found.text


def test_a_backward_that_does_twice_the_work_at_the_forwards_rate_is_not_flagged():
    """A conv on a CPU: backward 3.8x the forward's time for 2x its FLOPs (1.9x slower per FLOP) is expected; the
    same time for the same FLOPs as the forward (3.8x slower per FLOP) is worth a look."""
    conv = node("conv", 1.0, 3.8, fwd_flops=10**9, bwd_flops=2 * 10**9)
    odd = node("odd", 1.0, 3.8, fwd_flops=10**9, bwd_flops=10**9)
    assert [a.text.split("`")[1] for a in heavy_backward([conv, odd])] == ["odd"]


def test_slow_rank_with_nodes_lagging_equally_names_one():
    """Two of the slow rank's nodes lag by the same amount (sorting them must not compare the nodes themselves)."""
    cycle = [node("a", 1.0, slowest_rank=1, slowest_rank_ms=2.0), node("b", 1.0, slowest_rank=1, slowest_rank_ms=2.0)]
    (found,) = slow_rank([cycle] * 3, ranks=2)
    assert "Rank 1 was the slowest in 3 of 3 cycles, most in `" in found.text


def test_memory_bound_matmuls_that_share_the_time_get_one_piece_of_advice_together():
    """Eight Linear(1024, 1024) at a batch of 2, 12 % of the node time each: together they are the time."""
    layers = [node(f"fc{i}", 0.3, 1.2, fwd_flops=2 * 2 * 1024 * 1024, intensity=1.0, bound="memory", pct_of_peak=60.0,
                   fwd_gbytes_per_s=14.0) for i in range(8)]
    (found,) = memory_bound([*layers, node("relu", 0.05, 0.05)])
    assert found.text.startswith("8 matmuls or convs (99% of node time; the largest `fc0` (Linear), 12%) are memory-bound")
    assert "a larger batch" in found.text
    assert memory_bound([*layers[:1], node("other", 5.0, 5.0)]) == []  # one at 1.5 %: not the batch's problem
