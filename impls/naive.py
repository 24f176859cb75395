"""Standard attention that materialises the full score matrix: the baseline flash kernels are measured against."""

from __future__ import annotations

import torch

from impls._registry import Unsupported, register
from impls.contract import scatter_sequence
from impls.reference import attention_ref, score_bytes, serving_attention_ref


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024


@register("naive", family="naive", variants=("window", "softcap", "value_dim"),
          description="softmax(QK^T)V with the full Sq x Skv matrix, eager PyTorch")
def naive(q, k, v, *, causal: bool, scale: float, **variants):
    group = q.shape[1] // k.shape[1]
    needed = score_bytes(q, k) + (2 * k.numel() * k.element_size() * group if group > 1 else 0)
    free = free_memory_bytes(q.device)
    if needed > 0.8 * free:
        raise Unsupported(
            f"needs {needed / 2**30:.1f} GiB for the {q.shape[2]}x{k.shape[2]} score matrices "
            f"({needed} bytes); {free / 2**30:.1f} GiB free on {q.device.type}"
        )
    return lambda: attention_ref(q, k, v, causal=causal, scale=scale, upcast=False, chunk_bytes=None, **variants)


@register("naive", op="paged", family="naive", variants=("window", "softcap", "kv_fp8"),
          description="each sequence's pages gathered (an fp8 cache dequantized into q's dtype), then standard "
                      "attention per sequence, eager PyTorch")
@register("naive", op="varlen", family="naive", variants=("window", "softcap"),
          description="standard attention per packed sequence, eager PyTorch")
@register("naive", op="mixed", family="naive",
          description="each sequence's pages gathered, then standard attention per sequence (causal bottom-right "
                      "over its cache), eager PyTorch")
@register("naive", op="mla", family="naive", variants=("kv_fp8",),
          description="each sequence's latent and rotary rows gathered (an fp8 cache dequantized into q's dtype), "
                      "then standard attention per sequence over one kv head (scores latent + rotary wide, values "
                      "the latent rows), eager PyTorch")
def naive_serving(inputs, *, scale: float, **variants):
    def run():
        out = inputs.output_like()  # fresh each call: autograd through it (a packed backward's peer) needs that
        for b, o in serving_attention_ref(inputs, scale=scale, upcast=False, **variants).items():
            scatter_sequence(out, inputs, b, o)
        return out

    return run
