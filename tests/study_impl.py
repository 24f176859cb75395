"""A study registered for one preset only, like the blog's ladder: loaded as a plugin (``-p tests.study_impl``) by
the registry tests, never in a normal run."""

from __future__ import annotations

from impls import register
from impls.reference import attention_ref


@register("study-naive", family="study", presets=("cpu-bench",), description="the reference, for cpu-bench only")
def study(q, k, v, *, causal, scale):
    return lambda: attention_ref(q, k, v, causal=causal, scale=scale, upcast=False)
