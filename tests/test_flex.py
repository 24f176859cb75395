"""FlexAttention's adapter: its compiled function must stay compiled over a whole run of cases."""

from __future__ import annotations

import torch

from impls import flex


def test_compile_per_case_compiles_every_new_shape_past_dynamos_default_limit_of_eight() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(graph)
        return graph.forward

    doubled = flex.compile_per_case(lambda x: x * 2, backend=counting_backend)
    shapes = range(1, 13)  # 12 cases: dynamo's default limit would run the last 4 eagerly, uncompiled
    for n in shapes:
        assert torch.equal(doubled(torch.ones(n)), torch.full((n,), 2.0))
    assert len(graphs) == len(shapes)
    assert torch._dynamo.config.fail_on_recompile_limit_hit  # past the new limit: an error, never eager
