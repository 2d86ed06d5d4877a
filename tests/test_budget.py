"""glmvit.geometry, glmvit.packing (property tests), glmvit.costmodel (recommendations) and glmvit.workloads."""
import dataclasses
import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import glmvit.packing as packing
from glmvit import VisionConfig
from glmvit.costmodel import LatencyTable, TimeEstimate, graph_memory, predict_time, total_graph_memory
from glmvit.deployment import evaluate_budgets, plan_engine_steps, recommend_budgets
from glmvit.geometry import ItemSpec, grid_for, output_tokens, smart_resize
from glmvit.packing import (
    BudgetConfig,
    Plan,
    auto_budgets,
    combined_stats,
    compare_packers,
    default_ladder,
    parse_budgets,
    plan_batches,
    plan_workload,
    vllm_auto_range,
)
from glmvit.recorded import load_latency_table, table_from_dict
from glmvit.workloads import parse_bucket_config, random_mm_workload, workload_from_sizes

PACKERS = ["vllm", "ffd"]
MIXED = {(224, 224, 1): 1, (448, 448, 1): 1, (672, 672, 1): 1, (896, 896, 1): 1, (1120, 1120, 1): 1,
         (1344, 1344, 1): 1}


@st.composite
def workloads(draw):
    """A BudgetConfig and one request's items, some larger than every budget or with too many frames."""
    budgets = draw(st.lists(st.integers(1, 512), min_size=1, max_size=6))
    max_items = draw(st.integers(1, min(min(budgets), 12)))
    max_segments = draw(st.integers(max_items, max(max_items, min(max_items + 16, max(budgets)))))
    top_tokens, top_frames = draw(st.integers(1, 640)), draw(st.integers(1, 12))
    items = draw(st.lists(st.tuples(st.integers(1, top_tokens), st.integers(1, top_frames)), max_size=40))
    return BudgetConfig.resolve(tuple(budgets), max_items, max_segments), items


@st.composite
def frame_bound_workloads(draw):
    """Equal-token items whose frames, not tokens, decide the packing (where plain FFD can lose to next-fit): 16
    tokens each (room for every frame's token), a budget of max_items of them."""
    max_items = draw(st.integers(2, 6))
    max_segments = draw(st.integers(2 * max_items, 4 * max_items))
    items = draw(st.lists(st.tuples(st.just(16), st.integers(1, 9)), min_size=4, max_size=10))
    return BudgetConfig.resolve((16 * max_items,), max_items, max_segments), items


def fits(item, config):
    return item[0] <= config.largest and item[1] <= config.max_segments


# ----------------------------------------------------------------------------------------- packing properties
@pytest.mark.parametrize("packer", PACKERS)
@settings(max_examples=500, deadline=None)
@given(case=workloads())
def test_every_item_in_exactly_one_batch(packer, case):
    config, items = case
    plan = plan_batches(items, config, packer)
    placed = [i for b in plan.batches for i in b.item_indices]
    assert sorted(placed) == list(range(len(items)))


@pytest.mark.parametrize("packer", PACKERS)
@settings(max_examples=500, deadline=None)
@given(case=workloads())
def test_limits_and_smallest_fitting_budget(packer, case):
    config, items = case
    for batch in plan_batches(items, config, packer).batches:
        members = [items[i] for i in batch.item_indices]
        assert batch.tokens == sum(t for t, _ in members) and batch.segments == sum(f for _, f in members)
        if batch.budget is None:
            continue
        assert len(members) <= config.max_items
        assert batch.tokens <= config.largest and batch.segments <= config.max_segments
        assert batch.budget == min(b for b in config.token_budgets if b >= batch.tokens)


@pytest.mark.parametrize("packer", PACKERS)
@settings(max_examples=500, deadline=None)
@given(case=workloads())
def test_oversize_items_fall_back_alone(packer, case):
    config, items = case
    fallbacks = [b for b in plan_batches(items, config, packer).batches if b.budget is None]
    assert all(len(b.item_indices) == 1 for b in fallbacks)
    assert sorted(b.item_indices[0] for b in fallbacks) == [i for i, it in enumerate(items) if not fits(it, config)]


def quadratic_first_fit(items, config):
    """First-fit decreasing written the obvious O(n²) way: the oracle for the packer's tree."""
    order = sorted(range(len(items)), key=lambda i: (-items[i][0], -items[i][1], i))
    bins = []
    for i in order:
        t, s = items[i]
        for b in bins:
            if len(b) < config.max_items and sum(items[j][0] for j in b) + t <= config.largest \
                    and sum(items[j][1] for j in b) + s <= config.max_segments:
                b.append(i)
                break
        else:
            bins.append([i])
    return bins


@pytest.mark.parametrize("strategy", [workloads(), frame_bound_workloads()], ids=["mixed", "frame-bound"])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_first_fit_tree_equals_the_quadratic_first_fit(strategy, data):
    config, items = data.draw(strategy)
    fits = [i for i, (t, s) in enumerate(items) if t <= config.largest and s <= config.max_segments]
    specs = [ItemSpec(*item) for item in items]
    ffd = packing._first_fit(sorted(fits, key=lambda i: (-items[i][0], -items[i][1], i)), specs, config)
    assert ffd == [[fits[j] for j in b] for b in quadratic_first_fit([items[i] for i in fits], config)]


def test_first_fit_is_fast_on_a_huge_request():
    """128k items (a request of that many cannot reach a real model, but a trace can hold one): the tree keeps
    first fit O(n log n); the quadratic loop took minutes."""
    items = [(1 + i % 7, 1) for i in range(131_072)]
    plan = plan_batches(items, BudgetConfig((64, 128), 64, 64))
    assert sum(len(b.item_indices) for b in plan.batches) == len(items)
    assert all(b.tokens <= 128 and len(b.item_indices) <= 64 for b in plan.batches)


@settings(max_examples=500, deadline=None)
@given(case=workloads())
def test_vllm_packer_is_next_fit_in_ascending_order_with_deferral(case):
    config, items = case
    batches = [b for b in plan_batches(items, config, "vllm").batches if b.budget is not None]
    order = [i for b in batches for i in b.item_indices]
    assert order == sorted(order, key=lambda i: items[i][0])
    # a batch closes only when the next item does not fit, or when vLLM's rule defers it
    for batch, following in zip(batches, batches[1:], strict=False):
        t, f = items[following.item_indices[0]]
        full = (len(batch.item_indices) == config.max_items or batch.tokens + t > config.largest
                or batch.segments + f > config.max_segments)
        if not full:
            b_cur, b_alone, b_merged = (config.budget_for(x) for x in (batch.tokens, t, batch.tokens + t))
            assert b_cur + b_alone < b_merged and b_alone >= b_cur


@pytest.mark.parametrize("items, budgets, max_items, expected", [
    # vLLM 0.33.0's _execute_local (the wheel's vllm/v1/worker/encoder_cudagraph.py), traced by hand:
    # 64 then 200: b_cur 64 + b_alone 256 = 320 < b_merged 512, 256 ≥ 64 → deferred: two batches
    ([64, 200], (64, 128, 256, 512), 4, [((0,), 64), ((1,), 256)]),
    # 100 then 100: 128 + 128 = 256 is not < b_merged 256 → merged
    ([100, 100], (64, 128, 256, 512), 4, [((0, 1), 256)]),
    # 30, 30, 200: 30+30 merge (64+64 not < 64); 200: 64 + 256 = 320 < 512 and 256 ≥ 64 → deferred
    ([200, 30, 30], (64, 128, 256, 512), 4, [((1, 2), 64), ((0,), 256)]),
    # an item that alone does not outweigh the batch is never deferred (flood packing): 60+60+60, then 70
    ([60, 60, 60, 70], (64, 128, 256), 4, [((0, 1, 2, 3), 256)]),
    # max items closes a batch first; an item past the largest budget runs alone, eagerly
    ([10, 10, 10, 5000], (64, 128), 2, [((0, 1), 64), ((2,), 64), ((3,), None)]),
])
def test_vllm_packer_worked_cases(items, budgets, max_items, expected):
    plan = plan_batches([(t, 1) for t in items], BudgetConfig(budgets, max_items, 8), "vllm")
    assert [(b.item_indices, b.budget) for b in plan.batches] == expected


@settings(max_examples=500, deadline=None)
@given(case=workloads())
def test_stats_add_up(case):
    config, items = case
    plan = plan_batches(items, config)
    stats = plan.stats
    replays = [b for b in plan.batches if b.budget is not None]
    assert stats.real_tokens == sum(t for t, _ in items)
    assert stats.budget_tokens - stats.padded_tokens == sum(b.tokens for b in replays)
    assert stats.replays + stats.fallbacks == stats.batches == len(plan.batches)
    assert 0.0 <= stats.padding_fraction < 1.0


def test_ffd_beats_next_fit_on_a_frame_bound_example():
    """The packer falls back to next-fit where plain FFD would need 3 batches (see _pack_ffd)."""
    items = [(16, f) for f in (2, 7, 5, 1, 9, 2)]
    stats = compare_packers(items, BudgetConfig.resolve((48,), 3, 14))
    assert stats["ffd"].batches == stats["vllm"].batches == 2


def test_ffd_packs_tighter_than_next_fit():
    config = BudgetConfig.resolve((64, 128), max_items=4)
    items = [(10, 1), (10, 1), (58, 1), (58, 1), (58, 1), (58, 1)]
    stats = compare_packers(items, config)
    assert stats["ffd"].batches == 2 < stats["vllm"].batches == 3


def test_vllm_packer_worked_example():
    config = BudgetConfig.resolve((256, 512), max_items=2)
    plan = plan_batches([(300, 1), (100, 1), (200, 1), (5000, 1)], config, "vllm")
    # 100 + 200: 256 + 256 = 512 is not < b_merged 512 → merged; 300 starts a new batch (max items)
    assert [(b.item_indices, b.budget) for b in plan.batches] == [((1, 2), 512), ((0,), 512), ((3,), None)]


def test_empty_request_gives_empty_plan():
    assert plan_batches([], BudgetConfig.resolve()) == Plan(())


@pytest.mark.parametrize("item", [(0, 1), (-5, 1), (10, 0), (10, -1), (2.5, 1), (10,)])
def test_bad_items_are_rejected(item):
    with pytest.raises(ValueError, match="item 1"):
        plan_batches([(64, 1), item], BudgetConfig.resolve())


def test_unknown_packer():
    with pytest.raises(ValueError, match="unknown packer 'best'"):
        plan_batches([(64, 1)], BudgetConfig.resolve(), "best")


# ------------------------------------------------------------------------------------------------ budgets
@pytest.mark.parametrize("lo, hi, expected", [
    (64, 1024, [64, 128, 256, 512, 1024]),
    (64, 800, [64, 128, 256, 512, 800]),
    (64, 64, [64]),
])
def test_auto_budgets(lo, hi, expected):
    assert list(auto_budgets(lo, hi)) == expected


def test_auto_budgets_empty_range():
    with pytest.raises(ValueError, match="lo=128 > hi=64"):
        auto_budgets(128, 64)


def test_budget_config_defaults_follow_vllm():
    """The four branches of vLLM 0.33's EncoderCudaGraphManager.__init__ (vllm/v1/worker/encoder_cudagraph.py), with
    the GLM range (64, min(max_num_batched_tokens 8192, max_model_len 65536)) and 600 frames per video."""
    config = BudgetConfig.resolve()  # nothing given: auto budgets, max_batch = min(8192 // 64, 64)
    assert config.token_budgets == (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert config.max_items == 64 and config.max_segments == min(64 * 600, 8192)  # capped: ≤ 1 segment a token
    assert BudgetConfig.resolve(video=False).max_segments == 64
    assert BudgetConfig.resolve((512, 128)).max_items == min(8192 // 64, 128)  # budgets only
    assert BudgetConfig.resolve((16, 1024)).max_items == 16
    only_items = BudgetConfig.resolve(max_items=100)  # max items only: budgets from max(64, 100)
    assert only_items.token_budgets == (100, 200, 400, 800, 1600, 3200, 6400, 8192)
    both = BudgetConfig.resolve((128, 256), max_items=4, max_segments=32)  # both: as given
    assert (both.token_budgets, both.max_items, both.max_segments) == ((128, 256), 4, 32)
    assert vllm_auto_range(2048, 65_536) == (64, 2048) and vllm_auto_range(16_384, 4096) == (64, 4096)


def test_budget_config_sorts_and_deduplicates():
    config = BudgetConfig.resolve([256, 64, 256, 128], max_items=4, max_segments=8)
    assert config.token_budgets == (64, 128, 256)
    assert config.budget_for(65) == 128 and config.budget_for(64) == 64 and config.budget_for(257) is None


@pytest.mark.parametrize("kwargs, message", [
    ({"token_budgets": [64, 0]}, "token budget must be a positive integer, got 0"),
    ({"token_budgets": [64, -128]}, "got -128"),
    ({"token_budgets": [64, 96.5]}, "got 96.5"),
    ({"token_budgets": [64, "128"]}, "got '128'"),
    ({"token_budgets": [True]}, "got True"),
    ({"token_budgets": [64, 128], "max_items": 65}, "max_items=65 exceeds the smallest budget 64"),
    ({"max_items": 0}, "max_items must be a positive integer, got 0"),
    ({"max_items": 8, "max_segments": 4}, "max_segments=4 is below max_items=8"),
])
def test_budget_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BudgetConfig.resolve(**kwargs)


@pytest.mark.parametrize("budgets", [(128, 64), (64, 64), ()])
def test_budget_config_itself_takes_resolved_budgets_only(budgets):
    """The constructor never fills or reorders anything: resolve() does (a config's fields are what it holds)."""
    with pytest.raises(ValueError, match="strictly increasing"):
        BudgetConfig(budgets, 1, 1)


@pytest.mark.parametrize("largest, ladder", [
    (1, (64,)), (64, (64,)), (65, (64, 128)), (512, (64, 128, 256, 512)),
    (6000, (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144)),
])
def test_default_ladder(largest, ladder):
    assert default_ladder(largest) == ladder


@given(st.integers(1, 100_000))
def test_default_ladder_pads_a_batch_by_at_most_a_third_above_512(tokens):
    budget = BudgetConfig.for_requests([[ItemSpec(tokens, 1)]]).budget_for(tokens)
    assert budget is not None and budget >= tokens
    assert budget <= max(512, 2 * tokens) if tokens <= 512 else budget <= tokens * 3 / 2
    assert budget <= 512 or (budget - tokens) / budget < 1 / 3 + 1e-12


def test_for_requests_sizes_a_workload():
    requests = [[ItemSpec(64, 1)] * 3, [ItemSpec(1000, 4)]]
    config = BudgetConfig.for_requests(requests)
    assert config == BudgetConfig((64, 128, 256, 512, 768, 1024), 3, 4)
    assert BudgetConfig.for_requests(requests, max_items=2, max_segments=9) == BudgetConfig(config.token_budgets, 2, 9)


def test_parse_budgets():
    assert parse_budgets("64, 128 256") == (64, 128, 256)
    assert parse_budgets(" auto ") is None and parse_budgets("") is None
    with pytest.raises(ValueError, match="budget 'abc' is not an integer"):
        parse_budgets("64, abc")


# -------------------------------------------------------------------------------------------- smart_resize
@pytest.mark.parametrize("size, resized, tokens", [  # the table of examples, glm4v-vision-encoder.md §9
    ((224, 224), (224, 224), 64),
    ((480, 640), (476, 644), 391),
    ((1080, 1920), (1092, 1932), 2691),
    ((100, 100), (112, 112), 16),
    ((70, 70), (84, 84), 9),
    ((50, 3000), (56, 2996), 214),
    ((4000, 3000), (2520, 1876), 6030),
])
def test_smart_resize_table(size, resized, tokens):
    assert smart_resize(*size) == resized
    t, h, w = grid_for(*size)
    assert (t, h * 14, w * 14) == (1, *resized)
    assert output_tokens(t, h, w) == tokens


def test_smart_resize_half_to_even_and_class_default_max():
    assert smart_resize(238, 238) == (224, 224) and smart_resize(266, 266) == (280, 280)
    assert smart_resize(4000, 3000, max_pixels=11_760_000) == (2800, 2100)


@settings(max_examples=500, deadline=None)
@given(h=st.integers(1, 6000), w=st.integers(1, 6000), frames=st.sampled_from([2, 4, 16, 64]))
def test_smart_resize_matches_transformers(h, w, frames):
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as hf_smart_resize

    if max(h, w) / min(h, w) > 200:
        return
    kwargs = {"min_pixels": 12544, "max_pixels": 9_633_792}
    assert smart_resize(h, w, num_frames=frames, **kwargs) == hf_smart_resize(frames, h, w, **kwargs)


def test_smart_resize_errors():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(28, 28 * 201)
    # a side under 28 px is scaled up before the check; the error still names the size as given
    with pytest.raises(ValueError, match=r"^aspect ratio of 10×3,000 \(height×width\) exceeds 200:1$"):
        smart_resize(10, 3000)
    with pytest.raises(ValueError, match="num_frames=1"):
        smart_resize(224, 224, num_frames=1)
    with pytest.raises(ValueError, match="multiple of the merge size"):
        output_tokens(1, 15, 16)


def test_video_grid_counts_frame_pairs():
    assert grid_for(224, 224, 8) == (4, 16, 16)
    assert grid_for(224, 224, 7) == (4, 16, 16)
    item = workload_from_sizes([(224, 224, 8)])[0]
    assert item.spec == ItemSpec(tokens=256, segments=4)


# ------------------------------------------------------------------------------------------------ workloads
def test_random_mm_workload_is_seeded_and_follows_the_range():
    kwargs = dict(num_requests=1000, items_per_request=3, range_ratio=0.6, limit_per_request=4)
    a = random_mm_workload(MIXED, seed=1, **kwargs)
    assert a == random_mm_workload(MIXED, seed=1, **kwargs) != random_mm_workload(MIXED, seed=2, **kwargs)
    assert {len(r) for r in a} == {1, 2, 3, 4}  # [floor(1.2), min(ceil(4.8), 4)]


def test_random_mm_workload_probabilities_and_string_form():
    config = "{(224, 224, 1): 1, (448, 448, 1): 3, (896, 896, 1): 0}"
    requests = random_mm_workload(config, 4000, seed=0)
    assert requests == random_mm_workload(parse_bucket_config(config), 4000, seed=0)
    sizes = [item.height for r in requests for item in r]
    assert len(sizes) == 4000 and 896 not in sizes
    assert abs(sizes.count(448) / 4000 - 0.75) < 0.03


def test_random_mm_workload_video_items():
    (item,), = random_mm_workload({(224, 224, 8): 1.0}, 1)
    assert item.grid == (4, 16, 16) and (item.spec.tokens, item.spec.segments) == (256, 4)


@pytest.mark.parametrize("config, message", [
    ("{(224, 224, 1): }", "could not parse bucket_config"),
    ("[(224, 224, 1)]", "must be a non-empty dict"),
    ({}, "must be a non-empty dict"),
    ({(224, 224, 1): 0.0}, "must sum to > 0"),
    ({(224, 224, 1): -1.0}, "probability must be a finite number ≥ 0"),
    ({(224, 224): 1.0}, r"bucket key must be \(height, width, frames\)"),
    ({(224, 0, 1): 1.0}, "width must be a positive integer, got 0"),
])
def test_bucket_config_errors(config, message):
    with pytest.raises(ValueError, match=message):
        random_mm_workload(config, 10)


def test_workload_range_errors():
    with pytest.raises(ValueError, match="range_ratio"):
        random_mm_workload(MIXED, 10, range_ratio=1.5)
    with pytest.raises(ValueError, match="num_requests"):
        random_mm_workload(MIXED, 0)


# --------------------------------------------------------------------------------------------- cost model
@pytest.mark.parametrize("vision_config", [VisionConfig.glm41v(), VisionConfig.tiny()])
def test_graph_memory_grows_with_budget(vision_config):
    memories = graph_memory(BudgetConfig.resolve(), vision_config)
    assert [m.budget for m in memories] == list(BudgetConfig.resolve().token_budgets)
    for small, large in zip(memories, memories[1:], strict=False):
        assert small.static_bytes < large.static_bytes and small.pool_bytes < large.pool_bytes
    assert total_graph_memory(memories) == sum(m.static_bytes for m in memories) + memories[-1].pool_bytes
    wide = graph_memory(BudgetConfig.resolve(), vision_config, dtype="float32")
    assert all(w.total_bytes > m.total_bytes for w, m in zip(wide, memories, strict=False))


def test_graph_memory_metadata_matches_the_packed_layout():
    from glmvit.metadata import BatchShape

    vc, config = VisionConfig.tiny(), BudgetConfig.resolve((64,), max_items=4, max_segments=8)
    (memory,) = graph_memory(config, vc)
    rows = 64 * vc.merge_area
    metadata = BatchShape(rows, config.max_segments, rows).packed_size(vc.merge_area)
    assert memory.static_bytes == 2 * (rows * vc.patch_dim + 64 * vc.out_hidden_size) + 4 * metadata


def test_graph_memory_counts_the_prerotated_scratch_where_the_table_takes_that_path():
    """The cost model's row ranges are the launch table's; past 1024 rows a compiled triton graph's pool holds the
    (rows, 2·hidden) scratch of rotated q and k, and an uncompiled one's does not grow (costmodel's comment)."""
    from glmvit.costmodel import IN_LOOP_ROWS, POOL_BYTES_PER_ROW_HIDDEN, graph_memory, prerotated
    from glmvit.kernels.attention_table import config_for

    assert all(config_for(rows).prerotate == prerotated(rows) for rows in range(1, 4 * IN_LOOP_ROWS[1]))
    vc = VisionConfig.glm41v()
    below, above = IN_LOOP_ROWS[1] // vc.merge_area, 2 * IN_LOOP_ROWS[1] // vc.merge_area
    config = BudgetConfig.resolve((below, above))
    compiled = graph_memory(config, vc, compiled=True)
    plain = graph_memory(config, vc, compiled=False)
    library = graph_memory(config, vc, compiled=True, attention="varlen")

    def per_row(memories):
        return (memories[1].pool_bytes - memories[0].pool_bytes) / (above - below) / vc.merge_area

    scratch = 2 * vc.hidden_size * 2  # bytes per row, bf16
    base = per_row(plain), per_row(library)
    assert per_row(compiled) - scratch * above / (above - below) == pytest.approx(
        vc.hidden_size * 23.6, rel=1e-6)  # the fitted bytes per row·hidden, plus the scratch of every row above
    fitted = POOL_BYTES_PER_ROW_HIDDEN
    assert base == pytest.approx((vc.hidden_size * fitted[False, "triton"], vc.hidden_size * fitted[True, "library"]),
                                 rel=1e-6)  # unchanged: the fitted bytes alone


def test_graph_memory_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        graph_memory(BudgetConfig.resolve(), VisionConfig.tiny(), dtype="int8")


def synthetic_table():
    """Made-up latencies for tests only (graph replay cheaper than eager, both growing with tokens)."""
    tokens = [64, 128, 256, 512, 1024, 2048, 4096]
    return LatencyTable(tuple(tokens), tuple(1.0 + 0.004 * t for t in tokens),
                        tuple(6.0 + 0.005 * t for t in tokens), provenance={"source": "synthetic, tests"})


def test_latency_table_interpolates_and_extrapolates():
    table = synthetic_table()
    assert table.graph_time(128) == pytest.approx(1.512)
    assert table.graph_time(192) == pytest.approx((table.graph_time(128) + table.graph_time(256)) / 2)
    assert table.eager_time(8192) == pytest.approx(6.0 + 0.005 * 8192)
    steep = LatencyTable((100, 200), (1.0, 5.0), (1.0, 5.0))
    assert steep.graph_time(10) == 0.0  # extrapolation never goes negative


def test_load_latency_table_round_trip(tmp_path):
    table = synthetic_table()
    columns = zip(table.tokens, table.graph_ms, table.eager_ms, strict=False)
    rows = [{"tokens": t, "graph_ms": g, "eager_ms": e} for t, g, e in columns]
    path = tmp_path / "latency.json"
    path.write_text(json.dumps({"provenance": dict(table.provenance), "dtype": "bfloat16", "config": "glm41v",
                                "budgets": rows[::-1]}))
    assert load_latency_table(path) == dataclasses.replace(table, source=str(path))


@pytest.mark.parametrize("data, message", [
    ({"budgets": [{"tokens": 64, "graph_ms": 1.0, "eager_ms": 2.0}]}, "at least 2 budgets"),
    ({"budgets": [{"tokens": 64, "graph_ms": 1.0}, {"tokens": 128, "graph_ms": 2, "eager_ms": 3}]},
     "budgets.0.eager_ms: Field required"),
    ({"budgets": [{"tokens": 64, "graph_ms": 1, "eager_ms": 2}, {"tokens": 64, "graph_ms": 2, "eager_ms": 3}]},
     "strictly increasing"),
    ({"budgets": [{"tokens": 64, "graph_ms": -1, "eager_ms": 2}, {"tokens": 128, "graph_ms": 2, "eager_ms": 3}]},
     "budgets.0.graph_ms: Input should be greater than or equal to 0"),
    ({"budgets": [{"tokens": 64, "graph_ms": 0, "eager_ms": 2}, {"tokens": 128, "graph_ms": 2, "eager_ms": 3}]},
     "positive finite"),
    ({"budgets": [{"tokens": 64.0, "graph_ms": 1, "eager_ms": 2}, {"tokens": 128, "graph_ms": 2, "eager_ms": 3}]},
     "budgets.0.tokens: Input should be a valid integer"),
])
def test_bad_latency_tables(data, message):
    with pytest.raises(ValueError, match=message):
        table_from_dict(data)


def test_predict_time():
    table = synthetic_table()
    plan = plan_batches([(64, 1), (64, 1), (5000, 1)], BudgetConfig.resolve((64, 128), max_items=2))
    estimate = predict_time(plan, table)
    assert estimate.graph_ms == pytest.approx(table.graph_time(128))
    assert estimate.fallback_ms == pytest.approx(table.eager_time(5000))
    assert estimate.eager_ms == pytest.approx(table.eager_time(5128))  # the whole request in one forward


def test_predict_time_adds_the_real_attention():
    table = LatencyTable((64, 128), (4.0, 5.0), (2.0, 3.0), attention_ms=0.5, eager_floor_ms=15.0)
    clip, image = ItemSpec(256, 4), ItemSpec(64, 1)  # Σ L²: 4 segments of 256 rows; one of 256 rows
    assert clip.segment_rows2 == 4 * 256**2 and image.segment_rows2 == 256**2
    plan = plan_batches([image, image], BudgetConfig((64, 128), 2, 2))
    estimate = predict_time(plan, table)
    attention = 0.5 * 2 * 256**2 / 1e6
    assert estimate.graph_ms == pytest.approx(5.0 + attention)
    assert estimate.eager_ms == 15.0  # the host's launch time bounds a small eager forward from below
    slow = dataclasses.replace(table, eager_ms=(20.0, 30.0))  # an eager forward the GPU, not the host, bounds
    assert predict_time(plan, slow).eager_ms == pytest.approx(30.0 + attention)
    routed = predict_time(plan, dataclasses.replace(table, graph_ms=(40.0, 50.0)), route=True)
    assert routed.graph_ms == 0 and routed.fallback_ms == 15.0  # routed: the faster eager forward runs


# ---------------------------------------------------------------------------------------------- recommend
def specs(requests):
    return [[item.spec for item in request] for request in requests]


def mixed_workload(n=300, seed=42):
    """Requests as ItemSpec lists (what packing and the cost model take)."""
    return specs(random_mm_workload(MIXED, n, items_per_request=3, range_ratio=0.6, seed=seed, limit_per_request=4))


def workload_cost(requests, budgets, table=None):
    plans = plan_workload(requests, BudgetConfig.resolve(budgets, max_items=64))
    time = sum((predict_time(p, table) for p in plans), TimeEstimate()) if table else None
    return combined_stats(plans), time


def test_recommend_respects_max_graphs_and_beats_auto_on_padding():
    requests = mixed_workload()
    auto, _ = workload_cost(requests, None)
    previous = math.inf
    for k in range(1, 8):
        budgets = recommend_budgets(requests, k)
        stats, _ = workload_cost(requests, budgets)
        assert len(budgets) <= k and stats.fallbacks == 0
        assert stats.padded_tokens <= previous  # more graphs never pad more
        previous = stats.padded_tokens
    assert previous <= auto.padded_tokens


def test_recommend_beats_auto_on_predicted_time():
    requests, table = mixed_workload(), synthetic_table()
    budgets = recommend_budgets(requests, 7, table=table, objective="time")
    _, mine = workload_cost(requests, budgets, table)
    _, auto = workload_cost(requests, None, table)
    assert len(budgets) <= 7 and mine.total_ms <= auto.total_ms


def test_recommend_is_optimal_among_candidate_subsets():
    requests = specs(random_mm_workload(MIXED, 40, items_per_request=2, range_ratio=0.5, seed=3))
    candidates = [256, 576, 1024, 1600, 2304, 4096]
    budgets = recommend_budgets(requests, 3, candidates=candidates)
    best = min(
        (workload_cost(requests, subset)[0].padded_tokens
         for k in (1, 2, 3) for subset in itertools.combinations(candidates, k)
         if workload_cost(requests, subset)[0].fallbacks == 0),
    )
    assert workload_cost(requests, budgets)[0].padded_tokens == best


def test_recommend_respects_the_memory_limit():
    requests, vc = mixed_workload(), VisionConfig.glm41v()
    unlimited = recommend_budgets(requests, 7)
    limit = total_graph_memory(graph_memory(BudgetConfig.resolve(unlimited, 64), vc)) * 2 // 3
    budgets = recommend_budgets(requests, 7, memory_limit_bytes=limit)
    assert total_graph_memory(graph_memory(BudgetConfig.resolve(budgets, 64), vc)) <= limit
    with pytest.raises(ValueError, match="no budget set fits in memory_limit_bytes=1000"):
        recommend_budgets(requests, 7, memory_limit_bytes=1000)


def test_recommend_seed_workload_needs_one_graph():
    requests = specs(random_mm_workload({(224, 224, 1): 1.0}, 1000, seed=42))
    assert recommend_budgets(requests, 7) == (64,)


def test_recommend_refuses_anything_but_item_specs():
    with pytest.raises(ValueError, match="item 0 must be an ItemSpec"):
        recommend_budgets(random_mm_workload(MIXED, 2, seed=0), 3)


@pytest.mark.parametrize("kwargs, message", [
    ({"objective": "time"}, "needs a latency table"),
    ({"objective": "speed"}, "objective must be"),
    ({"max_graphs": 0}, "max_graphs must be a positive integer"),
    ({"candidates": [8, 16], "max_items": 32}, "no candidate budget is ≥ max_items=32"),
])
def test_recommend_errors(kwargs, message):
    args = {"max_graphs": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        recommend_budgets(mixed_workload(20), **args)


# ------------------------------------------------------------------ the cost model against recorded H200 runs
def test_recommend_never_proposes_budgets_slower_than_eager():
    """A table where replays cost more than eager forwards: recommending time must say eager wins, with both times."""
    from glmvit.deployment import EagerIsFaster

    slow_graphs = LatencyTable((64, 4096), (50.0, 500.0), (10.0, 20.0))
    with pytest.raises(EagerIsFaster, match="eager is predicted faster") as err:
        recommend_budgets(mixed_workload(20), 3, table=slow_graphs, objective="time")
    assert err.value.graph_ms > err.value.eager_ms > 0
    recommend_budgets(mixed_workload(20), 3, table=synthetic_table(), objective="time")  # graphs win here


def test_latency_fit_never_gives_a_budget_a_negative_base():
    """Timings from a loaded CPU: one layout of the larger budget happened to be very slow. The least-squares slope
    alone (≈ 229 ms per 10⁶ rows²) would leave the first budget a negative base; attention is capped at the time of
    the replay it is part of (5 ms for 0.2 · 10⁶ rows² here)."""
    def layout(work, ms):
        return {"name": f"{work}M", "segment_rows2": int(work * 1e6), "graph_ms": ms, "eager_ms": ms,
                "real_tokens": 16, "graph_p99_ms": ms, "eager_p99_ms": ms}

    rows = [{"tokens": 16, "graph_ms": 5.0, "eager_ms": 5.0, "layouts": [layout(0.1, 5.0), layout(0.2, 5.0)]},
            {"tokens": 64, "graph_ms": 450.0, "eager_ms": 5.0, "layouts": [layout(0.1, 5.0), layout(4.0, 900.0)]}]
    table = table_from_dict({"budgets": rows})
    assert all(ms > 0 for ms in table.graph_ms) and table.attention_ms == 5.0 / 0.2


def test_engine_steps_pack_consecutive_requests_per_modality():
    """Three 224² images and a clip arrive together: with a 256-token step budget, requests 0–2 (192 tokens) share
    a step and the clip (256 tokens) is the next; a step's images pack into one batch, unlike per request."""
    image, clip = ItemSpec(64, 1), ItemSpec(256, 4)
    requests = [[image], [image], [image], [clip], [image, clip]]
    config = BudgetConfig((64, 128, 256, 512), 4, 8)
    steps = plan_engine_steps(requests, config, step_tokens=256)
    assert [s.requests for s in steps] == [(0, 1, 2), (3,), (4,)]
    assert [[b.item_indices for b in p.batches] for p in steps[0].plans] == [[(0, 1, 2)]]
    assert len(steps[2].plans) == 2  # the image and the clip of request 4: one plan per modality
    per_step = evaluate_budgets(requests, config, synthetic_table(), per="step", step_tokens=256, packer="vllm")
    per_request = evaluate_budgets(requests, config, synthetic_table(), packer="vllm")
    assert (per_step.groups, per_request.groups) == (3, 5) and per_step.stats.replays < per_request.stats.replays
    assert per_step.graphs is not None and per_request.graphs is not None
    # a request waits for its whole step: requests 0-2 each take the step's time
    assert per_step.graphs.median_ms >= per_request.graphs.median_ms


@given(st.lists(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), min_size=1, max_size=6), min_size=1,
                max_size=4),
       st.lists(st.integers(1, 512), min_size=1, max_size=4, unique=True), st.booleans())
@settings(max_examples=200, deadline=None)
def test_derived_segment_slots_never_pass_the_largest_budget(requests, budgets, video):
    """Every derived max_segments follows one rule (BudgetConfig.segment_slots): what the workload or vLLM asks for,
    but at most the largest budget, so the graphs it sizes are never refused for it."""
    from glmvit.deployment import check_budget_fits

    budgets = sorted(budgets)
    specs = [[ItemSpec(max(t, s), s) for t, s in r] for r in requests]  # a segment has at least one token
    sized = BudgetConfig.for_requests(specs, budgets, max_items=1)
    wanted = max(sum(s.segments for s in r) for r in specs)
    assert sized.max_segments == min(wanted, budgets[-1])
    vllm = BudgetConfig.resolve(budgets, 1, video=video)
    assert vllm.max_segments == (min(600, budgets[-1]) if video else 1)
    for config in (sized, vllm):
        check_budget_fits(config, vision_config=VisionConfig.tiny(), weight_bytes=0)
    assert BudgetConfig.segment_slots(10**6, budgets) == budgets[-1]


# ---------------------------------------------------------------------------------------------- the config's invariants
def test_a_config_holds_its_own_invariants():
    """No caller caps a config: the constructor refuses what no graph could use, naming the bad value."""
    from glmvit.packing import MAX_BUDGET_TOKENS, MAX_BUDGETS

    with pytest.raises(ValueError, match="max_segments=129 exceeds the largest budget 128"):
        BudgetConfig((64, 128), 4, 129)
    with pytest.raises(ValueError, match=f"1000 budgets: at most {MAX_BUDGETS}"):
        BudgetConfig(tuple(range(1, 1001)), 1, 1)  # a library user cannot capture 1,000 graphs
    with pytest.raises(ValueError, match=f"1000 budgets: at most {MAX_BUDGETS}"):
        BudgetConfig.resolve(range(1, 1001), max_items=1)
    with pytest.raises(ValueError, match=f"budget {2 * MAX_BUDGET_TOKENS:,} is not in"):
        BudgetConfig((64, 2 * MAX_BUDGET_TOKENS), 1, 1)
    BudgetConfig(tuple(range(1, MAX_BUDGETS + 1)), 1, MAX_BUDGETS)  # the bounds themselves are allowed


def test_capped_limits_and_slots_follow_the_budgets():
    config = BudgetConfig.capped([256, 64], max_items=128, max_segments=10**6)
    assert config == BudgetConfig((64, 256), 64, 256)
    assert (config.slots(64), config.slots(256)) == (64, 256)
    assert BudgetConfig.capped([64], 4, 2) == BudgetConfig((64,), 4, 4)  # at least one segment an item


def test_serving_limits_are_the_library_defaults():
    from glmvit.packing import SERVING_LARGEST_BUDGET, SERVING_MAX_ITEMS, default_ladder

    assert BudgetConfig.serving() == BudgetConfig(default_ladder(SERVING_LARGEST_BUDGET), SERVING_MAX_ITEMS,
                                                  SERVING_MAX_ITEMS)
    assert BudgetConfig.serving((16, 32)) == BudgetConfig((16, 32), 16, 16)
    assert BudgetConfig.serving((64, 128), 2, 8) == BudgetConfig((64, 128), 2, 8)
    with pytest.raises(ValueError, match="exceeds the largest budget"):
        BudgetConfig.serving((64, 128), 2, 129)
    for bad in ({"max_items": 0}, {"max_segments": 0}):  # a bad limit is refused, not taken as one left out
        with pytest.raises(ValueError, match="must be a positive integer, got 0"):
            BudgetConfig.serving((64, 128), **bad)


@pytest.mark.parametrize("device, weights, tower, dtype", [
    ("cpu", False, "tiny", "fp32"), ("cuda", False, "full", "bf16"), ("cuda:1", True, "checkpoint", "bf16")])
def test_device_decides_the_tower_and_dtype(device, weights, tower, dtype):
    from glmvit.defaults import default_dtype, default_tower, tower_config

    assert (default_tower(device, weights), default_dtype(device)) == (tower, dtype)
    assert tower_config("tiny") == VisionConfig.tiny() and tower_config("full") == VisionConfig.glm41v()
    with pytest.raises(ValueError, match="tower 'checkpoint' has no config"):
        tower_config("checkpoint")
