"""MLX smoke test of python/fmkv/mlx.py (Apple silicon with `pip install mlx` and the fmkv binding;
run by .github/workflows/macos.yml, never on Linux). One sequence, no sink/window:
  * append through MLX, then every stored token's codes and scales are compared bit for bit with
    fmkv.quantize_vector (the reference arithmetic);
  * attention through MLX vs fmkv.reference.attention (float64), relative error <= 1e-5.
Exit status 1 on failure."""
import sys

import numpy as np

import fmkv
import fmkv.mlx as fm
from fmkv import reference

import mlx.core as mx


def unpack(words, bits):  # words [bits] uint32 of one group -> 32 codes (docs/FORMAT.md section 6)
    codes = np.zeros(32, np.uint8)
    for j in range(32):
        if bits == 4:  # format version 2: nibble j & 7 of word j >> 3 is the whole code
            codes[j] = (int(words[j >> 3]) >> (4 * (j & 7))) & 15
            continue
        sign = (int(words[bits - 1]) >> j) & 1
        if bits == 2:
            m = (int(words[0]) >> j) & 1
        else:
            i, lo = j & 15, j >> 4
            m = (int(words[i >> 3]) >> (8 * (2 * (i & 1) + lo) + 2 * ((i >> 1) & 3))) & 3
        codes[j] = (sign << (bits - 1)) | m
    return codes


def main() -> int:
    rng = np.random.default_rng(0)
    d, H, HQ, kb, vb, P, T, layer, seed = 128, 2, 8, 3, 4, 16, 70, 3, 12345
    cfg = dict(head_dim=d, num_kv_heads=H, k_bits=kb, v_bits=vb, page_size=P, scale_rule=1, seed=seed)
    k = rng.standard_normal((T, H, d)).astype(np.float16)
    v = rng.standard_normal((T, H, d)).astype(np.float16)
    npages = (T + P - 1) // P
    per_tok = lambda b: (d // 32) * (4 * b + 2)
    page_bytes = H * (per_tok(kb) + per_tok(vb)) * P
    pages = mx.zeros((npages * page_bytes,), dtype=mx.uint8)
    fk = mx.zeros((8,), dtype=mx.uint16)
    fv = mx.zeros((8,), dtype=mx.uint16)
    table = mx.array(np.arange(npages, dtype=np.int32).reshape(1, -1))
    st = fm.append(cfg, layer, pages, fk, fv, mx.array(k), mx.array(v), [0], [0, T], table)
    mx.eval(st, pages)
    if np.array(st).any():
        print("FAIL append status", np.array(st))
        return 1
    raw = np.array(pages).view(np.uint8)
    bad = 0
    for t in range(T):
        page = raw[(t // P) * page_bytes:(t // P + 1) * page_bytes]
        slot = t % P
        for h in range(H):
            off = h * (per_tok(kb) + per_tok(vb)) * P
            for is_v, bits, x in ((0, kb, k), (1, vb, v)):
                sec = page[off + (per_tok(kb) * P if is_v else 0):]
                words = sec[: (d // 32) * bits * P * 4].view(np.uint32)
                scales = sec[(d // 32) * bits * P * 4:].view(np.uint16)
                want_c, want_s = fmkv.quantize_vector(x[t, h], bits, seed, layer, "lsq")
                for g in range(d // 32):
                    got = unpack([words[(g * bits + w) * P + slot] for w in range(bits)], bits)
                    bad += int((got != want_c[g * 32:(g + 1) * 32]).any())
                    bad += int(scales[g * P + slot] != want_s.view(np.uint16)[g])
    print("append: %d mismatching groups" % bad)
    q = rng.standard_normal((4, HQ, d)).astype(np.float32)
    out, st = fm.attention(cfg, layer, pages, fk, fv, mx.array(q), [T], [0, 4], table)
    mx.eval(out, st)
    ref = reference.attention(fmkv.Config(head_dim=d, num_kv_heads=H, k_bits=kb, v_bits=vb, page_size=P,
                                          seed=seed), layer, k, v, q)
    err = reference.rel_error(np.array(out), ref)
    print("attention: rel error %.3g" % err)
    ok = bad == 0 and err <= 1e-5 and not np.array(st).any()
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
