"""``jaxpar._compiled.estimate``: launches, overlap and time from scheduled HLO (no GPU, no plugin).

The HLO modules here are written by hand in the text format XLA:GPU prints (see the
deviceless compiles in ``tests/test_compiled_preview.py``), so each rule of the model is checked
on a program small enough to compute by hand.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxpar._compiled import hlo
from jaxpar._compiled.estimate import estimate_hlo, verdict
from jaxpar._compiled.kernels import KernelCosts
from jaxpar._model.gpu import GPU_PROFILES, CommandBufferMode

PROFILE = GPU_PROFILES["h200"]
BIG = "f32[4096,4096]{1,0}"  # 64 MiB: bandwidth-bound kernels far above the floor


def _fusion(name: str, shape: str = "f32[8]{0}", operands: str = "%p0") -> str:
    return (f"  %{name} = {shape} fusion({operands}), kind=kLoop, calls=%fused_neg, "
            'backend_config={"operation_queue_id":"0"}')


FUSED = """%fused_neg (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %negate.0 = f32[8]{0} negate(%param_0)
}
"""


def _module(entry: list[str], extra: str = "", params: str = "%p0 = f32[8]{0} parameter(0)"
            ) -> str:
    body = "\n".join([f"  {params}", *entry])
    head = "ENTRY %main (p0: f32[8]) -> f32[8] {"
    return f"HloModule m, is_scheduled=true\n\n{FUSED}{extra}\n{head}\n{body}\n}}\n"


def _chain(n: int, prefix: str = "k") -> list[str]:
    lines = []
    previous = "%p0"
    for k in range(n):
        lines.append(_fusion(f"{prefix}{k}", operands=previous))
        previous = f"%{prefix}{k}"
    return lines


def test_straight_line_launches_and_launch_bound_time():
    estimate = estimate_hlo(_module(_chain(3)), command_buffers="off")
    assert estimate.launches == 3 and estimate.graph_launches == 0
    # Tiny kernels: the host launches each (2.7 us) and the device runs it (2 us floor).
    assert estimate.seconds == pytest.approx(3 * PROFILE.launch_s + PROFILE.kernel_floor_s)
    assert estimate.device_seconds == pytest.approx(3 * PROFILE.kernel_floor_s)


def test_five_kernels_become_one_graph_launch_by_default():
    off = estimate_hlo(_module(_chain(5)), command_buffers="off")
    lhs = estimate_hlo(_module(_chain(5)))
    assert lhs.command_buffers == "lhs" and lhs.graph_launches == 1 and lhs.launches == 5
    # A chain graph: one launch, a (cheap) node each on the host, the graph's floor per
    # dependent kernel on the device.
    assert lhs.seconds == pytest.approx(PROFILE.graph_launch_s + 5 * PROFILE.chain_node_s
                                        + 5 * PROFILE.graph_floor_s)
    assert off.graph_launches == 0
    # Four kernels stay below xla_gpu_graph_min_graph_size.
    assert estimate_hlo(_module(_chain(4))).graph_launches == 0


LOOP = """%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %b0 = f32[8]{0} fusion(%v), kind=kLoop, calls=%fused_neg
  %b1 = f32[8]{0} fusion(%b0), kind=kLoop, calls=%fused_neg
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %b1)
}
%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] fusion(%c), kind=kLoop, calls=%fused_neg
}
"""


def _loop(trips: int | None, name: str = "w", body: str = "body") -> str:
    config = f', backend_config={{"known_trip_count":{{"n":"{trips}"}}}}' if trips else ""
    return (f"  %{name} = (s32[], f32[8]{{0}}) while(%t0), condition=%cond, body=%{body}"
            f"{config}")


def test_known_trip_count_multiplies_launches_without_host_syncs():
    entry = ["  %t0 = (s32[], f32[8]{0}) tuple(%p0, %p0)", _loop(10_000)]
    estimate = estimate_hlo(_module(entry, LOOP), command_buffers="off")
    assert estimate.launches == 20_000 and estimate.host_syncs == 0
    assert estimate.unknown_trip_loops == 0
    # Host bound: 2 launches per trip, extrapolated from three replayed trips.
    assert estimate.seconds == pytest.approx(20_000 * PROFILE.launch_s
                                             + PROFILE.kernel_floor_s, rel=1e-6)


def test_nested_loops_multiply():
    outer = LOOP.replace("%body (", "%outer (").replace("%b0 = f32[8]{0} fusion(%v), kind=kLoop, "
                                                        "calls=%fused_neg\n", "").replace(
        "%b1 = f32[8]{0} fusion(%b0), kind=kLoop, calls=%fused_neg",
        '%t0 = (s32[], f32[8]{0}) tuple(%i, %v)\n  %inner = (s32[], f32[8]{0}) while(%t0), '
        'condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}\n'
        "  %b1 = f32[8]{0} get-tuple-element(%inner), index=1")
    entry = ["  %t0 = (s32[], f32[8]{0}) tuple(%p0, %p0)", _loop(3, body="outer")]
    estimate = estimate_hlo(_module(entry, LOOP + outer), command_buffers="off")
    assert estimate.launches == 3 * 7 * 2


def test_unknown_trip_count_syncs_every_trip_and_is_flagged():
    entry = ["  %t0 = (s32[], f32[8]{0}) tuple(%p0, %p0)", _loop(None)]
    estimate = estimate_hlo(_module(entry, LOOP), command_buffers="off", unknown_trips=4)
    assert estimate.unknown_trip_loops == 1
    assert estimate.host_syncs == 5  # one per trip, and the one that says stop
    assert estimate.launches == 4 * 3 + 1
    known = estimate_hlo(_module(["  %t0 = (s32[], f32[8]{0}) tuple(%p0, %p0)", _loop(4)],
                                 LOOP), command_buffers="off")
    assert estimate.seconds > known.seconds + 5 * PROFILE.sync_s


REGIONS = """%region_a (a: f32[4096,4096]) -> f32[4096,4096] {
  %a = f32[4096,4096]{1,0} parameter(0)
  ROOT %ka = f32[4096,4096]{1,0} fusion(%a), kind=kLoop, calls=%fused_big
}
%region_b (b: f32[4096,4096]) -> f32[4096,4096] {
  %b = f32[4096,4096]{1,0} parameter(0)
  ROOT %kb = f32[4096,4096]{1,0} fusion(%b), kind=kLoop, calls=%fused_big
}
%fused_big (param_0.1: f32[4096,4096]) -> f32[4096,4096] {
  %param_0.1 = f32[4096,4096]{1,0} parameter(0)
  ROOT %exp = f32[4096,4096]{1,0} exponential(%param_0.1)
}
"""


def _start(name: str, region: str, stream: int, group: str | None = "1") -> str:
    attributes = f'_xla_stream_annotation="{stream}",inlineable="false"'
    if group:
        attributes = f'_scheduling_group_id="{group}",' + attributes
    return (f"  %{name} = ((f32[4096,4096]{{1,0}}), f32[4096,4096]{{1,0}}) call-start(%p0), "
            f"to_apply=%{region}, frontend_attributes={{{attributes}}}")


def _done(name: str, start: str) -> str:
    return f"  %{name} = f32[4096,4096]{{1,0}} call-done(%{start})"


BIG_PARAM = "%p0 = f32[4096,4096]{1,0} parameter(0)"


def test_two_regions_in_flight_together_overlap():
    entry = [_start("sa", "region_a", 1), _start("sb", "region_b", 2), _done("da", "sa"),
             _done("db", "sb")]
    estimate = estimate_hlo(_module(entry, REGIONS, BIG_PARAM), command_buffers="off")
    assert [r.overlaps for r in estimate.regions] == [True, True]
    assert {r.kernels_beside for r in estimate.regions} == {1}
    # Two bandwidth-bound kernels share one GPU: overlap hides no roofline work. The
    # first starts once the host has recorded its event and launched it.
    work = 2 * (2 * 64 * 2**20) / PROFILE.bandwidth
    assert estimate.seconds == pytest.approx(work + PROFILE.launch_s + PROFILE.event_s,
                                             rel=1e-6)


def test_start_right_before_done_is_no_overlap():
    entry = [_start("sa", "region_a", 1), _done("da", "sa"), _start("sb", "region_b", 2),
             _done("db", "sb")]
    estimate = estimate_hlo(_module(entry, REGIONS, BIG_PARAM), command_buffers="off")
    assert [r.overlaps for r in estimate.regions] == [False, False]
    assert [r.kernels_beside for r in estimate.regions] == [0, 0]
    assert "0 of 2 stream regions overlap" in verdict(estimate, estimate)


def test_region_beside_main_stream_kernel_overlaps():
    entry = [_start("sa", "region_a", 1),
             "  %main_k = f32[8]{0} fusion(%p1), kind=kLoop, calls=%fused_neg",
             _done("da", "sa")]
    text = _module(entry, REGIONS, BIG_PARAM + "\n  %p1 = f32[8]{0} parameter(1)")
    (region,) = estimate_hlo(text, command_buffers="off").regions
    assert region.overlaps and region.kernels_beside == 1 and region.scheduling_group == "1"


def test_conditional_inside_a_region_blocks_the_host():
    branch = """%region_c (a: f32[4096,4096]) -> f32[4096,4096] {
  %a = f32[4096,4096]{1,0} parameter(0)
  %pred = pred[] constant(true)
  ROOT %cnd = f32[4096,4096]{1,0} conditional(%pred, %a, %a), true_computation=%region_a, \
false_computation=%region_b
}
"""
    entry = [_start("sa", "region_c", 1), _start("sb", "region_b", 2), _done("da", "sa"),
             _done("db", "sb")]
    estimate = estimate_hlo(_module(entry, REGIONS + branch, BIG_PARAM), command_buffers="off")
    blocked, free = estimate.regions
    assert blocked.host_blocking == ("cnd",) and not blocked.overlaps
    assert free.overlaps
    assert estimate.host_syncs == 1
    assert "1 hold host syncs" in verdict(estimate, estimate)


def _tiny_regions(together: bool) -> str:
    regions = "".join(
        f"%r{k} (a{k}: f32[8]) -> f32[8] {{\n  %a{k} = f32[8]{{0}} parameter(0)\n"
        + "".join(f"  %r{k}k{j} = f32[8]{{0}} fusion(%a{k}), kind=kLoop, calls=%fused_neg\n"
                  for j in range(3))
        + f"  ROOT %r{k}out = f32[8]{{0}} fusion(%r{k}k2), kind=kLoop, calls=%fused_neg\n}}\n"
        for k in range(2))
    starts = [f"  %s{k} = ((f32[8]{{0}}), f32[8]{{0}}) call-start(%p0), to_apply=%r{k}, "
              f'frontend_attributes={{_scheduling_group_id="1",_xla_stream_annotation="{k + 1}"}}'
              for k in range(2)]
    dones = [f"  %d{k} = f32[8]{{0}} call-done(%s{k})" for k in range(2)]
    entry = [starts[0], starts[1], dones[0], dones[1]] if together else \
        [starts[0], dones[0], starts[1], dones[1]]
    return _module(entry + _chain(2, "tail"), regions)


def test_lhs_graphs_chain_captured_regions_serially():
    text = _tiny_regions(together=True)
    lhs = estimate_hlo(text, command_buffers=CommandBufferMode.LHS)
    concurrent = estimate_hlo(text, command_buffers="concurrent")
    assert lhs.graph_launches == 1 == concurrent.graph_launches
    assert all(r.capturable and r.overlaps for r in lhs.regions)
    serial = estimate_hlo(_tiny_regions(together=False), command_buffers="lhs")
    assert lhs.seconds == pytest.approx(serial.seconds)  # the overlap is gone
    assert concurrent.seconds < lhs.seconds - 3 * PROFILE.kernel_floor_s
    assert "2 lose it in LHS CUDA graphs" in verdict(serial, lhs)


def test_region_holding_a_loop_is_never_captured():
    # A body of 5 kernels: captured as one graph per trip at top level, launched kernel
    # by kernel inside a region (docs/xla.md, "Stream regions inside graphs").
    body5 = LOOP.replace("%body (", "%body5 (").replace(
        "  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %b1)",
        "".join(f"  %b{k} = f32[8]{{0}} fusion(%b{k - 1}), kind=kLoop, calls=%fused_neg\n"
                for k in range(2, 5)) + "  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %b4)")
    region = """%rl (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %t0 = (s32[], f32[8]{0}) tuple(%a, %a)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body5, \
backend_config={"known_trip_count":{"n":"100"}}
  ROOT %out = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    entry = ['  %s = ((f32[8]{0}), f32[8]{0}) call-start(%p0), to_apply=%rl, '
             'frontend_attributes={_xla_stream_annotation="1"}', "  %d = f32[8]{0} call-done(%s)"]
    top = ["  %t0 = (s32[], f32[8]{0}) tuple(%p0, %p0)", _loop(100, body="body5")]
    inside = estimate_hlo(_module(entry, body5 + region))
    at_top = estimate_hlo(_module(top, body5))
    assert inside.launches == at_top.launches == 500
    (info,) = inside.regions
    assert not info.capturable
    assert at_top.graph_launches == 100 and inside.graph_launches == 0
    per_trip_graph = PROFILE.graph_launch_s + 5 * PROFILE.chain_node_s
    assert at_top.seconds == pytest.approx(
        100 * max(per_trip_graph, 5 * PROFILE.graph_floor_s) + per_trip_graph, rel=0.05)
    assert inside.seconds == pytest.approx(500 * PROFILE.launch_s + PROFILE.kernel_floor_s
                                           + PROFILE.event_s, rel=1e-6)
    # Without graphs the two are the same program, give or take the region's events.
    assert estimate_hlo(_module(entry, body5 + region), command_buffers="off").seconds == \
        pytest.approx(estimate_hlo(_module(top, body5), command_buffers="off").seconds
                      + PROFILE.event_s, rel=1e-6)


def test_dynamic_slice_of_a_parameter_reads_only_the_slice():
    fused = """%fused_slice (param_0: f32[10000,100,100], param_1: s32[]) -> f32[1,100,100] {
  %param_0 = f32[10000,100,100]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,100,100]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), \
dynamic_slice_sizes={1,100,100}
}
"""
    module = hlo.Module(hlo.parse_computations(_module([], fused))[1])
    cost = KernelCosts(module, PROFILE)._fusion("fused_slice")
    assert cost.bytes == pytest.approx(2 * 100 * 100 * 4 + 4)


def test_dot_flops_from_a_gemm_fusion_use_the_tf32_peak():
    fused = """%gemm (p0: f32[512,256], p1: f32[256,1024]) -> f32[512,1024] {
  %p0 = f32[512,256]{1,0} parameter(0)
  %p1 = f32[256,1024]{1,0} parameter(1)
  ROOT %dot = f32[512,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    module = hlo.Module(hlo.parse_computations(_module([], fused))[1])
    cost = KernelCosts(module, PROFILE)._fusion("gemm")
    assert cost.tensor_seconds == pytest.approx(2 * 512 * 1024 * 256 / 494.5e12)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="command_buffers"):
        estimate_hlo(_module(_chain(1)), command_buffers="fast")
    with pytest.raises(ValueError, match="gpu"):
        estimate_hlo(_module(_chain(1)), gpu="a100")
    with pytest.raises(ValueError, match="unknown_trips"):
        estimate_hlo(_module(_chain(1)), unknown_trips=0)
    with pytest.raises(ValueError, match="ENTRY"):
        estimate_hlo("HloModule m\n")


def test_verdict_says_faster_slower_or_same():
    slow = estimate_hlo(_module(_chain(3)), command_buffers="off")
    fast = dataclasses.replace(slow, seconds=slow.seconds / 2, launches=2)
    assert verdict(slow, fast).startswith("faster by 50%")
    assert "launches 3 -> 2" in verdict(slow, fast)
    assert verdict(fast, slow).startswith("slower by 100%")
    assert verdict(slow, slow).startswith("about the same")


