"""Shared ops. Importing this package registers every builder."""
from tessera.ops import activation, attention, embedding, latent_attention, linear, linear_attention, linear_int4, linear_int8, lora_rows, moe, moe_mxfp4, moe_quantized, norm, rotary  # noqa: F401
from tessera.ops.cpu import (  # noqa: F401
    activation as cpu_activation, embedding as cpu_embedding, linear as cpu_linear, norm as cpu_norm, paged_decode as cpu_paged_decode,
    paged_prefill as cpu_paged_prefill,
    kv_write as cpu_kv_write, linear_int4 as cpu_linear_int4, linear_int8 as cpu_linear_int8, lora_rows as cpu_lora_rows, rotary as cpu_rotary,
    moe_mxfp4 as cpu_moe_mxfp4, moe_experts as cpu_moe_experts, moe_routing as cpu_moe_routing, gated_delta as cpu_gated_delta, ssm_scan as cpu_ssm_scan,
    gating as cpu_gating, latent_attention as cpu_latent_attention,
)
from tessera.ops.triton import (  # noqa: F401
    activation as triton_activation, int4_linear as triton_int4_linear, int8_linear as triton_int8_linear, kv_write as triton_kv_write, paged_decode as triton_paged_decode,
    mxfp4_linear as triton_mxfp4_linear, moe_experts as triton_moe_experts, causal_conv1d as triton_causal_conv1d, gated_delta as triton_gated_delta,
    paged_prefill as triton_paged_prefill, rms_norm as triton_rms_norm, rotary as triton_rotary, ssm_scan as triton_ssm_scan,
    skinny_linear as triton_skinny_linear, rotary_kv_write as triton_rotary_kv_write,
)
from tessera.ops.registry import OpSpec, OpTarget, get_op, select_op

__all__ = ["OpSpec", "OpTarget", "get_op", "select_op"]
