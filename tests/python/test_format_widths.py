"""The supported code widths and head dims come from one rule (include/fmkv/format.h): what the library accepts,
what fmkv.format lists, what the error messages and the evaluation's config parser name, all agree."""
import pytest

import fmkv
from fmkv import format as fmt


def _accepted_widths():
    ok = []
    for b in range(0, 40):
        try:
            fmkv.bytes_per_token_head(64, b)
            ok.append(b)
        except fmkv.FmkvError:
            pass
    return ok


def test_code_bits_are_what_the_library_accepts():
    assert fmt.CODE_BITS == (2, 3, 4, 5)  # docs/FORMAT.md section 6 (an independent statement of the rule)
    assert _accepted_widths() == list(fmt.CODE_BITS) + [fmt.FP16_BITS]
    assert fmt.CODEBOOK_MAX_BITS == max(fmt.CODE_BITS)
    for b in range(1, fmt.CODEBOOK_MAX_BITS + 1):
        assert len(fmkv.codebook(b)) == 2 ** (b - 1)
    with pytest.raises(fmkv.FmkvError, match=r"codebooks exist for 1\.\.5 bits"):
        fmkv.codebook(fmt.CODEBOOK_MAX_BITS + 1)


@pytest.mark.parametrize("field,value,listed", [("k_bits", 6, "2, 3, 4, 5 or 16"), ("v_bits", 16, "2, 3, 4 or 5"),
                                                ("head_dim", 96, "64, 128 or 256")])
def test_messages_list_exactly_the_supported_values(field, value, listed):
    with pytest.raises(fmkv.FmkvError, match=rf"{field} {value} is not supported \({listed}\)"):
        fmkv.Config(**{"head_dim": 64, "num_kv_heads": 1, field: value})


def test_width_texts_from_the_library():
    assert fmt.CODE_BITS_TEXT == "2, 3, 4 or 5" and fmt.K_CODE_BITS_TEXT == "2, 3, 4, 5 or 16"


def test_eval_config_parser_takes_the_widths_from_the_library():
    from fmkv.eval.quantizers import parse_config

    for kb in fmt.CODE_BITS + (fmt.FP16_BITS,):
        for vb in fmt.CODE_BITS:
            assert parse_config(f"k{kb}v{vb}").k_bits == kb
    for bad in ("k6v3", "k3v16", "k1v2"):
        with pytest.raises(ValueError, match=r"k_bits must be 2, 3, 4, 5 or 16 and v_bits 2, 3, 4 or 5"):
            parse_config(bad)
    with pytest.raises(ValueError, match=r"turbo-<2\|3\|4\|5>"):
        parse_config("turbo-6")


def test_needle_widths_from_the_library(tmp_path):
    """fmkv-eval needle: --bits defaults to every code width the backend runs (plus fp16 K), refuses a width the format
    lacks, and one the backend does not run with the backend's error."""
    import json
    import subprocess
    import sys

    run = lambda *a: subprocess.run([sys.executable, "-m", "fmkv.eval", "needle", *a], capture_output=True, text=True,
                                    timeout=300)
    r = run("--bits", "6")
    assert r.returncode == 2 and "k width 6 is not supported (expected one of [2, 3, 4, 5])" in r.stderr
    r = run("--bits", "5", "--backend", "cuda", "--max-ctx", "1024")  # the backend's own error, before any work
    if not fmkv.backends()["cuda"]["available"]:
        assert r.returncode == 2 and "needle: --bits 5:" in r.stderr and "'cuda'" in r.stderr, r.stderr
    out = tmp_path / "needle.jsonl"
    r = run("--max-ctx", "1024", "--trials", "1", "--head-dim", "64", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    backend = fmkv.default_backend()
    runs = [b for b in fmt.CODE_BITS if fmkv.backend_supports(backend, fmkv.Config(head_dim=64, num_kv_heads=1, k_bits=b))]
    assert runs == list(fmt.CODE_BITS)  # the host backends have every width
    assert sorted({row["k_bits"] for row in rows}) == runs + [fmt.FP16_BITS]


def test_check_backend_names_the_option_and_the_backends_that_have_it():
    """fmkv.check_backend raises what every op of the backend would (fmkv_backend_check_config): every compiled
    backend takes 5-bit codes and scale group 64; a backend that is not compiled or has no device is refused as
    unavailable, naming it; an unknown backend is an error."""
    five = fmkv.Config(head_dim=64, num_kv_heads=1, k_bits=5, v_bits=4)
    sg64 = fmkv.Config(head_dim=64, num_kv_heads=1, k_bits=4, v_bits=4, scale_group=64)
    for b in ("ref", "cpu", "cuda"):
        if fmkv.backends()[b]["available"]:
            for c in (five, sg64):
                fmkv.check_backend(b, c)
                assert fmkv.backend_supports(b, c)
        else:
            with pytest.raises(fmkv.FmkvError, match=rf"backend '{b}' is not compiled into this build or has no usable") as e:
                fmkv.check_backend(b, five)
            assert e.value.status == "UNSUPPORTED" and not fmkv.backend_supports(b, sg64)
    with pytest.raises(fmkv.FmkvError, match="unknown backend"):
        fmkv.check_backend("tpu", five)
