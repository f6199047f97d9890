"""The KV-cache dtypes a user names on the command line (torch-free: argparse reads it)."""

# command-line name -> the cache's KV dtype name (None: the checkpoint's kv_cache_scheme, else its
# plan.json's, else the activation dtype)
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None, "fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8_e4m3", "int8": "int8",
    "int4": "int4", "int2": "int2",
}
KV_CACHE_DTYPE_HELP = ("KV cache dtype: auto (the checkpoint's kv_cache_scheme, else its KV plan's, else the "
                       "activation dtype), fp32/bf16/fp16, fp8 or int8 (per token and head), int4 or int2 (keys "
                       "per channel over 64-token blocks, int2 keys before RoPE, values per token; the block being "
                       "filled stays exact)")
