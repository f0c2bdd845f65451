"""Bytes one cp rank receives per layer in forward (backward sends as much back): softmax attention's gather of K and
V or of the MLA latent (core/context.py), linear attention's chunk summaries and conv tails (core/linear_attention.py).
`python -m tools.cp_traffic` prints both tables (README's Measured rows)."""

from core.context import _check_seq_len


def cp_bytes_received_per_layer(seq_len: int, cp: int, numbers_per_token: int, bytes_per_element: int = 2) -> int:
    """The other ranks' (cp-1)/cp of the sequence, numbers_per_token values each (G * (D + E) for K and V, or the MLA
    latent width)."""
    _check_seq_len(seq_len, cp)
    return (cp - 1) * (seq_len // cp) * numbers_per_token * bytes_per_element


def print_cp_bytes_table(seq_len: int = 32768, cps=(2, 4, 8), bytes_per_element: int = 2) -> None:
    models = [  # (name, numbers gathered per token per layer)
        ("Qwen3-30B-A3B     K,V: 4 x (128+128)", 4 * (128 + 128)),
        ("GPT-OSS-20B       K,V: 8 x (64+64)", 8 * (64 + 64)),
        ("DeepSeek-V2-Lite  K,V: 16 x (192+128)", 16 * (192 + 128)),
        ("DeepSeek-V2-Lite  latent: 512+64", 512 + 64),
    ]
    print(f"MiB received per cp rank per layer (forward), {seq_len} tokens, {8 * bytes_per_element}-bit")
    print(f"{'model / what is gathered':38s} {'numbers/token':>13s}" + "".join(f"{'cp=' + str(c):>10s}" for c in cps))
    for name, per_token in models:
        mib = [cp_bytes_received_per_layer(seq_len, c, per_token, bytes_per_element) / 2**20 for c in cps]
        print(f"{name:38s} {per_token:13d}" + "".join(f"{m:10.2f}" for m in mib))


def cp_linear_attention_bytes_received_per_layer(cp: int, value_heads: int, key_dim: int, value_dim: int,
                                                 conv_channels: int, conv_width: int, batch: int = 1,
                                                 state_bytes: int = 4, activation_bytes: int = 2) -> int:
    """Per linear-attention layer: 2 (cp - 1) chunk summaries [K, K + V] per value head in fp32 and 2 (cp - 1) conv
    tails of W - 1 inputs per channel."""
    summaries = 2 * (cp - 1) * batch * value_heads * key_dim * (key_dim + value_dim) * state_bytes
    tails = 2 * (cp - 1) * batch * (conv_width - 1) * conv_channels * activation_bytes
    return summaries + tails


def print_cp_linear_bytes_table(cps=(2, 4, 8), seq_len: int = 32768) -> None:
    """Qwen3.5-35B-A3B's Gated DeltaNet layer (Qwen3_5MoeTextConfig: 16 key heads, 32 value heads, K = V = 128,
    conv width 4 over q, k, v = 2*16*128 + 32*128 = 8192 channels), per sequence, next to an all-gather of the
    conv inputs (what a gathered-activation scheme would move, bf16)."""
    Hk, Hv, K, V, W = 16, 32, 128, 128, 4
    channels = 2 * Hk * K + Hv * V
    print(f"KiB received per cp rank per Gated DeltaNet layer and sequence (forward), Qwen3.5-35B-A3B; "
          f"gathering the {channels} conv inputs of {seq_len} tokens instead, bf16")
    print(f"{'':28s}" + "".join(f"{'cp=' + str(c):>12s}" for c in cps))
    rows = [("summaries + tails", [cp_linear_attention_bytes_received_per_layer(c, Hv, K, V, channels, W)
                                   for c in cps]),
            ("  of which conv tails", [2 * (c - 1) * (W - 1) * channels * 2 for c in cps]),
            (f"all-gather {seq_len} tokens", [(c - 1) * (seq_len // c) * channels * 2 for c in cps])]
    for name, values in rows:
        print(f"{name:28s}" + "".join(f"{b / 2**10:12.0f}" for b in values))


if __name__ == "__main__":
    print_cp_bytes_table()
    print()
    print_cp_linear_bytes_table()
