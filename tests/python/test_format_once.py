"""The format exists once: no known constant or formula of docs/FORMAT.md outside the format core
(tools/check_format_once.py), and the checker itself finds a planted copy."""
import importlib.util
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_format_once", ROOT / "tools" / "check_format_once.py")
chk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chk)


def test_no_rule_is_stated_twice():
    bad = chk.scan(ROOT)
    assert not bad, "format rules restated outside the format core:\n" + "\n".join(bad)


def test_checker_finds_a_planted_copy(tmp_path):
    for top in chk.SCANNED:
        (tmp_path / top).mkdir()
    shutil.copy(ROOT / "include" / "fmkv" / "format.h", tmp_path / "include" / "format_copy.h")
    (tmp_path / "python" / "x.py").write_text("E = max(cfg.sink_tokens, n - cfg.window_tokens)\nB = (d // 32) * (4 * bits + 2)\n")
    bad = chk.scan(tmp_path)
    rules = {b.split(": ", 1)[1].split(" (its home")[0] for b in bad}
    assert "layout: bytes per token per head" in rules and "token regions: compressed end max(S, len - W)" in rules
    assert "rotation: splitmix64 and layer-mixing constants" in rules and any(b.startswith("python/x.py:2:") for b in bad)


def test_checker_finds_a_restated_width_set(tmp_path):
    """A copy of the supported code widths (a check or a message) outside format.h / format_text.hpp is found."""
    for top in chk.SCANNED:
        (tmp_path / top).mkdir()
    (tmp_path / "python" / "w.py").write_text("ok = bits in (2, 3, 4)\n")
    (tmp_path / "src" / "w.cpp").write_text('fail("v_bits is not supported (2, 3 or 4)");\n')
    (tmp_path / "cli" / "w.cpp").write_text("for (int b : {2, 3, 4, 16}) {}\n")
    bad = chk.scan(tmp_path)
    assert sorted(b.split(":", 1)[0] for b in bad if "code widths" in b) == ["cli/w.cpp", "python/w.py", "src/w.cpp"]
