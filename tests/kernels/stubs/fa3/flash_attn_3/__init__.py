"""Stand-in for the compiled ``flash_attn_3`` package (ours): see ``_C``."""
