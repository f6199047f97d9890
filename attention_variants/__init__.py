"""kvslim.attention_variants: rewrites of a pretrained model's attention (GQA/MQA, KV sharing, sliding window)."""
