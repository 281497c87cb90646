"""``jaxpar._compiled.hlo``: the compiled HLO text parsed into computations of instructions.

The module's text is written by hand in the format XLA:GPU prints (jaxlib 0.10.2 and 0.12),
small enough to read every answer off it.
"""

from __future__ import annotations

import textwrap

import pytest

from jaxpar._compiled import hlo

_TEXT = textwrap.dedent(
    """\
        HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

        %fused_dot (param_0: f32[4,4]) -> f32[4,4] {
          %param_0 = f32[4,4]{1,0} parameter(0)
          ROOT %dot.1 = f32[4,4]{1,0} dot(%param_0, %param_0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        }

        %fused_neg (param_0.1: f32[4]) -> f32[4] {
          %param_0.1 = f32[4]{0} parameter(0)
          ROOT %negate = f32[4]{0} negate(%param_0.1)
        }

        %body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
          %p = (s32[], f32[4]{0}) parameter(0)
          %n = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_neg
          %m = f32[4,4]{1,0} fusion(%p), kind=kCustom, calls=%fused_dot
          ROOT %t = (s32[], f32[4]{0}) tuple(%p, %n)
        }, execution_thread="parallel"

        %cond (p.1: (s32[], f32[4])) -> pred[] {
          %p.1 = (s32[], f32[4]{0}) parameter(0)
          ROOT %c = pred[] fusion(%p.1), kind=kLoop, calls=%fused_neg
        }

        %gather_computation (g: f32[4]) -> f32[16] {
          %g = f32[4]{0} parameter(0)
          ROOT %ag = f32[16]{0} all-gather(%g), replica_groups={{0,1,2,3}}, dimensions={0}
        }

        ENTRY %main (x: f32[4]) -> f32[4] {
          %x = f32[4]{0} parameter(0)
          %start = ((f32[4]{0}), f32[16]{0}) async-start(%x), calls=%gather_computation
          %done = f32[16]{0} async-done(%start)
          %w = (s32[], f32[4]{0}) while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
          %k = f32[4]{0} custom-call(%x), custom_call_target="__cublas$gemm", frontend_attributes={_xla_stream_annotation="2",inlineable="false"}, backend_config={not json}
          ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
        }
        """  # noqa: E501
)


def _module() -> tuple[str, list[hlo.Computation], hlo.Module]:
    name, computations = hlo.parse_computations(_TEXT)
    return name, computations, hlo.Module(computations)


def _instruction(name: str) -> hlo.Instruction:
    _, computations, _ = _module()
    return next(i for c in computations for i in c.instructions if i.name == name)


def test_computations_in_text_order_with_their_entry_and_thread() -> None:
    name, computations, _ = _module()
    assert name == "jit_f"
    assert [c.name for c in computations] == [
        "fused_dot", "fused_neg", "body", "cond", "gather_computation", "main"]
    assert [c.name for c in computations if c.is_entry] == ["main"]
    threads = {c.name: c.execution_thread for c in computations}
    assert threads["body"] == "parallel" and threads["main"] is None
    assert [i.name for i in computations[-1].instructions] == ["x", "start", "done", "w", "k",
                                                              "r"]
    assert hlo.parse_computations("not an HLO module") == ("", [])


def test_an_instruction_line_is_read_into_its_parts() -> None:
    line = ('  ROOT %t.2 = (s32[], f32[4]{0}) tuple(%p, %n.1), sharding={{replicated}, '
            '{maximal device=0}}')
    instruction = hlo.parse_instruction(line)
    assert instruction == hlo.Instruction(
        "t.2", "tuple", ("p", "n.1"), ", sharding={{replicated}, {maximal device=0}}",
        "(s32[], f32[4]{0})", "%p, %n.1")
    assert hlo.parse_instruction("  %p = f32[8]{0} parameter(0)").arguments == "0"
    # A computation's header, its closing brace and a blank line hold no instruction.
    assert hlo.parse_instruction("%body (p: f32[4]) -> f32[4] {") is None
    assert hlo.parse_instruction("}") is None
    assert hlo.parse_instruction("") is None


def test_attribute_values_come_without_brackets_or_quotes() -> None:
    attributes = _instruction("k").attributes
    assert hlo.attribute(attributes, "custom_call_target") == "__cublas$gemm"
    assert hlo.attribute(attributes, "frontend_attributes") == (
        '_xla_stream_annotation="2",inlineable="false"')
    assert hlo.attribute(_instruction("r").attributes, "index") == "1"
    assert hlo.attribute(attributes, "calls") is None
    # A key is matched whole: ``condition=`` is no ``on=``.
    assert hlo.attribute(_instruction("w").attributes, "on") is None


def test_called_computations_in_the_order_of_the_keys() -> None:
    assert hlo.called(_instruction("w").attributes, "body", "condition") == ("body", "cond")
    assert hlo.called(_instruction("w").attributes, "to_apply") == ()
    branches = ", branch_computations={%left, %right}, true_computation=%t"
    assert hlo.called(branches, "branch_computations", "true_computation") == (
        "left", "right", "t")


def test_frontend_attributes_backend_config_and_trip_count() -> None:
    assert hlo.frontend_attributes(_instruction("k")) == {
        "_xla_stream_annotation": "2", "inlineable": "false"}
    assert hlo.frontend_attributes(_instruction("w")) == {}
    assert hlo.backend_config(_instruction("w")) == {"known_trip_count": {"n": "7"}}
    assert hlo.backend_config(_instruction("k")) == {}  # not JSON
    assert hlo.known_trip_count(_instruction("w")) == 7
    assert hlo.known_trip_count(_instruction("k")) is None


def test_the_module_answers_roots_kernels_and_control_flow() -> None:
    _, _, module = _module()
    root = module.root("gather_computation")
    assert root is not None and root.opcode == "all-gather"
    assert module.root("no_such_computation") is None
    # ENTRY: the custom call; the while's condition (one fusion) and body (two), once each.
    assert module.count_kernels("main") == 4
    # The cuBLAS call and the fusion whose body holds the dot.
    assert module.count_kernels("main", dots_only=True) == 2
    assert module.contains_dot("fused_dot") and not module.contains_dot("fused_neg")
    assert module.is_dot_kernel(_instruction("k")) and not module.is_dot_kernel(_instruction("n"))
    # Fusion bodies run inside one kernel: they are no control computation.
    assert module.control_computations() == {"main", "body", "cond", "gather_computation"}


@pytest.mark.parametrize("root, expected", [
    ("ROOT %ag = f32[16]{0} all-gather(%g), dimensions={0}", ("collective", "all-gather")),
    ("ROOT %cp = f32[4]{0} collective-permute-start(%g)", ("collective", "collective-permute")),
    ("ROOT %c = f32[4]{0} copy(%g)", ("copy", None)),
    ("ROOT %c = f32[4]{0} call(%g), to_apply=%f", ("compute", None)),
    ('ROOT %c = f32[4]{0} call(%g), to_apply=%f, frontend_attributes={_collectives_group=""}',
     ("collective", "collectives-group")),
])
def test_an_async_start_is_what_it_wraps(root: str, expected: tuple[str, str | None]) -> None:
    text = (f"%wrapped (g: f32[4]) -> f32[4] {{\n  %g = f32[4]{{0}} parameter(0)\n  {root}\n}}\n"
            "ENTRY %main (x: f32[4]) -> f32[4] {\n  %x = f32[4]{0} parameter(0)\n"
            "  ROOT %s = ((f32[4]{0}), f32[4]{0}) async-start(%x), calls=%wrapped\n}\n")
    _, computations = hlo.parse_computations(text)
    start = computations[-1].instructions[-1]
    assert hlo.async_kind(start, hlo.Module(computations)) == expected


def test_shapes_in_bytes_elements_and_dimensions() -> None:
    shape = "(bf16[2,3]{1,0}, pred[5], f8e4m3fn[4], s32[])"
    assert hlo.arrays(shape) == [("bf16", 6), ("pred", 5), ("f8e4m3fn", 4), ("s32", 1)]
    assert hlo.shape_bytes(shape) == 2 * 6 + 5 + 4 + 4  # an f8 at one byte
    assert hlo.shape_bytes("token[]") == 0
    assert hlo.elements("f32[8,128]{1,0}") == 1024 and hlo.elements("()") == 0
    assert hlo.dims("f32[8,128]{1,0}") == [8, 128]
    assert hlo.element_type("bf16[8]{0}") == "bf16" and hlo.element_type("()") == "f32"
    assert hlo.int_list("{1,0}") == [1, 0] and hlo.int_list(None) == []
